"""The process's resident memory for the peer scripts' memory columns (Linux `/proc/self`)."""


def reset_peak():
    """`VmHWM` set to the current RSS, so that the peak measured is the steps' (not the inputs'
    creation, whose f32 temporaries are larger than bf16 inputs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def resident_mib(field):
    """`VmRSS` or `VmHWM` in MiB."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")
