# Sourced by the install and test scripts beside it (after they cd to the checkout's root): the version that
# setup.cfg gives a package, so that each script installs what the package declares.
#
# Usage: version=$(setup_cfg_version PACKAGE OPERATOR WHERE)   e.g. setup_cfg_version accelerate ">=" install_requires
# Prints the version of the line "PACKAGE<OPERATOR>X..." (the first); without one, says where it was looked for and
# exits with 1.
setup_cfg_version() {
    found=$(sed -n "s/^ *$1$2\([0-9][0-9.]*\).*/\1/p" setup.cfg | head -n 1)
    if [ -z "$found" ]; then
        echo "setup.cfg has no '$1$2X' line (its $3) to take $1's version from" >&2
        exit 1
    fi
    echo "$found"
}
