#!/usr/bin/env bash
# libaio for DeepSpeed's async_io op (ZeRO-Infinity: --offload-optimizer/--offload-params nvme), best effort.
# - Already there (libaio.h compiles and -laio links, as DeepSpeed's own check does): silent, ~0.1 s.
# - Missing, running as root with apt-get: installs the distribution's libaio-dev (apt-get update only if the
#   install fails without it).
# - Otherwise: one line saying nvme offload will be refused and how to enable it.
# Always exits 0: nothing else in stratbench needs libaio.
set -u

have_libaio() {
    local cc=${CC:-cc}
    if command -v "$cc" >/dev/null 2>&1; then
        printf '#include <libaio.h>\nint main(void) { io_context_t c = 0; return io_setup(1, &c); }\n' |
            "$cc" -x c - -o /dev/null -laio >/dev/null 2>&1
    else
        [ -f /usr/include/libaio.h ]
    fi
}

[ "$(uname -s)" = Linux ] || exit 0  # libaio is Linux's; elsewhere DeepSpeed refuses nvme offload anyway
have_libaio && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt_install() {
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libaio-dev >/dev/null 2>&1
    }
    if apt_install || { apt-get update -qq >/dev/null 2>&1 && apt_install; }; then
        if have_libaio; then
            echo "install: installed libaio-dev (DeepSpeed's async_io op, for --offload-* nvme)"
            exit 0
        fi
    fi
    echo "install: could not install libaio-dev with apt-get: --offload-optimizer/--offload-params nvme will be" \
        "refused; enable it with: apt-get update && apt-get install libaio-dev"
    exit 0
fi
echo "install: libaio's headers are missing: --offload-optimizer/--offload-params nvme will be refused; enable it" \
    "with: sudo apt-get install libaio-dev (Fedora/RHEL: libaio-devel)"
exit 0
