"""Run pytorch-accelerated 0.1.61's own test suite against pytorch_accel_trainer, imports renamed.

    .venv/bin/python tests/peer/run_peer_suite.py [--sdist PATH] [pytest args...]

It downloads 0.1.61's source distribution from the package index (or takes ``--sdist``), copies its
``test/`` folder into a temporary folder, renames ``pytorch_accelerated`` to ``pytorch_accel_trainer``
in every file, and runs pytest there with this interpreter (its tests need pytest-mock, in the ``test`` extra).
Nothing of the peer is installed or imported.
The tests expected to fail here (private internals this trainer does differently) are listed in
docs/differences.md; the script prints the pass rate and exits non-zero below 90%.
"""

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PEER = "pytorch-accelerated==0.1.61"
REQUIRED_PASS_RATE = 0.90


def download_sdist(folder):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            PEER,
            "-d",
            str(folder),
        ],
        check=True,
    )
    return next(Path(folder).glob("pytorch_accelerated-*.tar.gz"))


def renamed_test_folder(sdist, folder):
    with tarfile.open(sdist) as archive:
        archive.extractall(folder, filter="data")
    source = next(Path(folder).glob("pytorch_accelerated-*/test"))
    target = Path(folder) / "peer_suite" / "test"
    shutil.copytree(source, target)
    for path in target.rglob("*.py"):
        path.write_text(path.read_text().replace("pytorch_accelerated", "pytorch_accel_trainer"))
    return target.parent


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdist", type=Path, help="a local pytorch_accelerated-0.1.61.tar.gz (default: download it)")
    args, pytest_args = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as folder:
        sdist = args.sdist or download_sdist(folder)
        root = renamed_test_folder(sdist, folder)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-q",
                "-rf",
                "--rootdir",
                str(root),
                "-c",
                "/dev/null",
                "test",
                *pytest_args,
            ],
            cwd=root,
            capture_output=True,
            text=True,
        )
    print(result.stdout[-20000:], result.stderr[-5000:], sep="\n")
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", summary)) else 0
    failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|error)", summary))
    total = passed + failed
    rate = passed / total if total else 0.0
    print(f"peer suite ({PEER}): {passed}/{total} passed ({rate:.1%}); required {REQUIRED_PASS_RATE:.0%}")
    return 0 if rate >= REQUIRED_PASS_RATE else 1


if __name__ == "__main__":
    sys.exit(main())
