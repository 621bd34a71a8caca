"""The resident memory of a long training run, step by step: the Trainer beside hand-written loops.

    python benchmarks/memory_growth.py             # 520 steps a row, 4 rows: about 4 minutes on 2 busy cores
    python benchmarks/memory_growth.py --quick     # a smoke run: 40 steps, a vocabulary of 128, about 30 s
    python benchmarks/memory_growth.py --steps 1000 --vocab 4096 --rows torch_loop,trainer_default

Each row is a fresh process, on the CPU with one thread, that trains a small GPT-2 (transformers' ``GPT2LMHeadModel``
built from a ``GPT2Config``, nothing downloaded: 2 layers, width 128, 2 heads, a vocabulary of ``--vocab``) for one
epoch of ``--steps`` steps of 8 sequences of 64 tokens, with AdamW, and reads its resident set size
(``/proc/self/statm``) at the start of every step, before the forward pass. The rows: a hand-written PyTorch loop, the
same with an ``accelerate.Accelerator``, ``Trainer`` with the default callbacks, and ``Trainer`` with none but the one
that reads the memory. The hand loops sum the loss on the device and read it once, as the trainer does.

Per row: the resident memory at steps 5, 250, 300 and 510 (those the run reaches) and at its last step, the highest
read, each over the torch loop's, and the growth: the least-squares slope of the memory over the steps from step 20
on (MiB a step) and the highest read above that of step 20. Goal (not judged by ``--quick``): for each trainer row, a
slope of at most 0.02 MiB a step (10 MiB over 500 steps) and a highest read at most 1.1 times the torch loop's.

It prints a markdown table and writes ``results.md`` and ``results.json`` (every read included) to ``--output-dir``
(default ``benchmarks/results/memory_growth/``); it exits with status 1 if a row failed or did not train, or (without
``--quick``) a goal was missed. See benchmarks/README.md, "Memory over a long run".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from launch import launcher  # benchmarks/launch.py, beside this file

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT_DIR = REPO_ROOT / "benchmarks" / "results" / "memory_growth"
ROWS = ("torch_loop", "accelerate_loop", "trainer_default", "trainer_no_callbacks")
BASELINE_ROW = "torch_loop"
TRAINER_ROWS = ("trainer_default", "trainer_no_callbacks")
#: The steps whose memory the table shows (the issue's), where the run reaches them; and always the last.
REPORT_STEPS = (5, 250, 300, 510)
#: The growth is measured from this step on: the first steps allocate the optimizer's state and warm the allocator.
WARMUP_STEPS = 20
BATCH, SEQUENCE_LENGTH, WIDTH, LAYERS, HEADS, LR = 8, 64, 128, 2, 2, 1e-3
DATA_SEED, MODEL_SEED, TRAIN_SEED = 0, 0, 42
GOAL_SLOPE_MIB_PER_STEP = 0.02
GOAL_PEAK_RATIO = 1.1


# ------------------------------------------------------------------------------------------------
# Worker: one row in this process
# ------------------------------------------------------------------------------------------------


def rss_mib() -> float:
    """The resident set size of this process now, in MiB (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class TokenSequences:
    """Sequences whose next token is a fixed function of the current one (so that the model learns), as dicts of
    ``input_ids`` and ``labels`` (the model shifts the labels itself)."""

    def __init__(self, num_samples: int, vocab: int):
        import torch

        generator = torch.Generator().manual_seed(DATA_SEED)
        tokens = torch.empty(num_samples, SEQUENCE_LENGTH, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (num_samples,), generator=generator)
        for position in range(1, SEQUENCE_LENGTH):
            tokens[:, position] = (tokens[:, position - 1] * 7 + 3) % vocab
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def make_model(vocab: int):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # a config without a tokenizer's special tokens is fine here
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_embd=WIDTH,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=SEQUENCE_LENGTH,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(MODEL_SEED)
    return transformers.GPT2LMHeadModel(config)


def hand_loop(model, optimizer, dataset, reads: list, use_accelerate: bool) -> float:
    """The loop people write by hand (plain PyTorch, or with an ``Accelerator``); returns the epoch's mean loss."""
    import torch
    from torch.utils.data import DataLoader

    torch.manual_seed(TRAIN_SEED)
    dataloader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    backward = torch.Tensor.backward
    if use_accelerate:
        from accelerate import Accelerator

        accelerator = Accelerator()
        model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
        backward = accelerator.backward
    model.train()
    loss_sum, count = torch.zeros(()), 0
    for batch in dataloader:
        reads.append(rss_mib())
        loss = model(**batch).loss
        loss_sum += loss.detach() * batch["labels"].size(0)
        count += batch["labels"].size(0)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return loss_sum.item() / count


def trainer_run(model, optimizer, dataset, reads: list, default_callbacks: bool) -> float:
    """``Trainer.train`` for one epoch, with a callback that reads the memory at each step's start."""
    from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
    from pytorch_accel_trainer.callbacks import TrainerCallback

    class ReadMemory(TrainerCallback):
        def on_train_step_start(self, trainer, **kwargs):
            reads.append(rss_mib())

    callbacks = [ReadMemory(), *DEFAULT_CALLBACKS] if default_callbacks else [ReadMemory()]
    trainer = Trainer(model, loss_func=None, optimizer=optimizer, callbacks=callbacks)
    trainer.train(train_dataset=dataset, num_epochs=1, per_device_batch_size=BATCH)
    return float(trainer.run_history.get_latest_metric("train_loss_epoch"))


def run_worker(row: str, steps: int, vocab: int) -> dict:
    import torch

    import pytorch_accel_trainer

    torch.set_num_threads(1)
    dataset = TokenSequences(steps * BATCH, vocab)
    model = make_model(vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    reads: list = []
    rss_before_run = rss_mib()
    started = time.perf_counter()
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        if row in TRAINER_ROWS:
            loss = trainer_run(model, optimizer, dataset, reads, default_callbacks=row == "trainer_default")
        else:
            loss = hand_loop(model, optimizer, dataset, reads, use_accelerate=row == "accelerate_loop")
    return {
        "row": row,
        "steps": steps,
        "vocab": vocab,
        "rss_before_run_mib": rss_before_run,
        "rss_at_step_start_mib": reads,  # index 0: step 1
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,  # KiB on Linux
        "loss": loss,
        "seconds": time.perf_counter() - started,
        "package": str(Path(pytorch_accel_trainer.__file__).parent),
    }


# ------------------------------------------------------------------------------------------------
# Driver: a fresh process per row, then the figures and the table
# ------------------------------------------------------------------------------------------------


def worker_environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "1"}


def measure_row(args, row: str) -> dict:
    command = [*launcher(1), str(Path(__file__).resolve()), "--worker", row]
    command += ["--steps", str(args.steps), "--vocab", str(args.vocab)]
    try:
        completed = subprocess.run(
            command, env=worker_environment(), capture_output=True, text=True, cwd=REPO_ROOT, timeout=args.timeout
        )
    except subprocess.TimeoutExpired as error:
        return {"row": row, "error": f"killed after {args.timeout} s: {str(error.stderr or '')[-2000:]}"}
    if completed.returncode != 0:
        return {
            "row": row,
            "error": f"exit status {completed.returncode}: {(completed.stdout + completed.stderr)[-3000:]}",
        }
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    return {**result, **figures(result["rss_at_step_start_mib"], args.vocab, result["loss"]), "error": None}


def slope(values: list) -> float:
    """The least-squares slope of ``values`` over their indices (0 for fewer than 2)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
    return covariance / sum((x - mean_x) ** 2 for x in range(n))


def figures(reads: list, vocab: int, loss: float) -> dict:
    """What the table shows of one row's reads (``reads[i]``: the memory at the start of step ``i + 1``)."""
    after_warmup = reads[WARMUP_STEPS - 1 :] if len(reads) > WARMUP_STEPS else reads
    steps = [step for step in REPORT_STEPS if step <= len(reads)] + [len(reads)]
    return {
        "rss_at_mib": {str(step): reads[step - 1] for step in dict.fromkeys(steps)},
        "peak_read_mib": max(reads),
        "slope_mib_per_step": slope(after_warmup),
        "growth_mib": max(after_warmup) - after_warmup[0],
        # below the loss of a uniform guess, ln(vocab): the model learned the next-token rule
        "trained": math.isfinite(loss) and loss < 0.9 * math.log(vocab),
    }


def goals(rows: list) -> list:
    """``(row, goal, verdict)`` for each trainer row measured beside the torch loop."""
    baseline = next((row for row in rows if row["row"] == BASELINE_ROW and not row["error"]), None)
    verdicts = []
    for row in rows:
        if row["row"] not in TRAINER_ROWS or row["error"] or baseline is None:
            continue
        flat = row["slope_mib_per_step"] <= GOAL_SLOPE_MIB_PER_STEP
        verdicts.append((row["row"], f"slope <= {GOAL_SLOPE_MIB_PER_STEP} MiB/step", "PASS" if flat else "FAIL"))
        ratio = row["peak_read_mib"] / baseline["peak_read_mib"]
        verdicts.append(
            (row["row"], f"peak <= {GOAL_PEAK_RATIO} x {BASELINE_ROW}", "PASS" if ratio <= GOAL_PEAK_RATIO else "FAIL")
        )
    return verdicts


def machine() -> dict:
    import importlib.metadata

    versions = {name: importlib.metadata.version(name) for name in ("torch", "accelerate", "transformers")}
    return {
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        **versions,
        "platform": platform.platform(),
    }


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def table(rows: list) -> list:
    measured = [row for row in rows if not row["error"]]
    steps = list(dict.fromkeys(step for row in measured for step in row["rss_at_mib"]))
    by_name = {row["row"]: row for row in measured}
    baselines = [name for name in ("torch_loop", "accelerate_loop") if name in by_name]
    header = "| row | " + " | ".join(f"step {step}" for step in steps) + " | highest read |"
    header += "".join(f" highest × {name} |" for name in baselines)
    header += " slope MiB/step | growth MiB | loss | trained |"
    lines = [header, "|---|" + "---:|" * (len(steps) + 1 + len(baselines) + 3) + "---|"]
    for row in rows:
        if row["error"]:
            lines.append(f"| `{row['row']}` | FAIL: {row['error'][:200]!r} |")
            continue
        cells = [f"{row['rss_at_mib'][step]:.0f}" for step in steps] + [f"{row['peak_read_mib']:.0f}"]
        cells += [f"{row['peak_read_mib'] / by_name[name]['peak_read_mib']:.2f}" for name in baselines]
        cells += [f"{row['slope_mib_per_step']:+.3f}", f"{row['growth_mib']:.0f}", f"{row['loss']:.3f}"]
        cells.append("yes" if row["trained"] else "FAIL")
        lines.append(f"| `{row['row']}` | " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict) -> str:
    setup = result["setup"]
    host = setup["machine"]
    lines = [
        "# Memory over a long run",
        "",
        f"{setup['date']}; {host['cpu_cores']} CPU cores, torch {host['torch']}, accelerate {host['accelerate']}, "
        f"transformers {host['transformers']}, Python {host['python']}; load average at the start "
        f"{setup['load_average']}, at the end {setup['load_average_end']}; {setup['seconds']:.0f} s in all"
        f"{' (--quick: goals not judged)' if setup['quick'] else ''}.",
        "",
        f"GPT2LMHeadModel ({LAYERS} layers, width {WIDTH}, vocabulary {setup['vocab']}), batches of {BATCH} x "
        f"{SEQUENCE_LENGTH} tokens, AdamW, one thread, {setup['steps']} steps of one epoch; each row a fresh process. "
        "Resident memory (MiB) at the start of the step, before the forward pass; the slope and the growth from step "
        f"{WARMUP_STEPS} on.",
        "",
        *table(result["rows"]),
    ]
    if result["goals"]:
        lines += ["", "| row | goal | verdict |", "|---|---|---|"]
        lines += [f"| `{row}` | {goal} | {verdict} |" for row, goal, verdict in result["goals"]]
    return "\n".join(lines) + "\n"


def failed(result: dict) -> bool:
    if any(row["error"] or not row["trained"] for row in result["rows"]):
        return True
    return not result["setup"]["quick"] and any(verdict == "FAIL" for _, _, verdict in result["goals"])


def run_driver(args) -> int:
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    setup = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "load_average": load_average(),
        "steps": args.steps,
        "vocab": args.vocab,
        "quick": args.quick,
        "pythonpath": os.environ.get("PYTHONPATH", ""),
    }
    print(f"load average {setup['load_average']}; rows {', '.join(args.rows)}", flush=True)
    started = time.perf_counter()
    rows = []
    for row in args.rows:
        rows.append(measure_row(args, row))
        brief = {key: value for key, value in rows[-1].items() if key != "rss_at_step_start_mib"}
        print(f"{row}: {json.dumps(brief)[:400]}", flush=True)
    setup["seconds"] = time.perf_counter() - started
    setup["load_average_end"] = load_average()
    result = {"setup": setup, "rows": rows, "goals": [] if args.quick else goals(rows)}
    text = markdown(result)
    print(text)
    (output_dir / "results.md").write_text(text)
    (output_dir / "results.json").write_text(json.dumps(result, indent=1))
    print(f"written to {output_dir}/results.md and results.json")
    return 1 if failed(result) else 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=520, help="training steps of each row (default 520)")
    parser.add_argument("--vocab", type=int, default=1024, help="the model's vocabulary (default 1024)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="40 steps, a vocabulary of 128; goals not judged")
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR))
    parser.add_argument("--timeout", type=int, default=900, help="seconds each row may take (default 900)")
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.vocab = 40, 128
    args.rows = args.rows.split(",")
    unknown = [row for row in args.rows if row not in ROWS]
    if unknown:
        parser.error(f"--rows {','.join(unknown)} is not valid: choose from {', '.join(ROWS)}")
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps {args.steps} leaves no step after the warm-up: pass more than {WARMUP_STEPS}")
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.steps, args.vocab)))
        return 0
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
