"""Command lines for the CLI tests, written as keywords instead of one list item per word."""

from __future__ import annotations


def cli_args(*words: object, **options: object) -> list[str]:
    """``words`` as given, then one flag per keyword: ``seq_lens=(16, 32)`` gives ``--seq-lens 16 32``,
    ``no_progress=True`` gives ``--no-progress``, and False or None leave the flag out."""
    argv = [str(w) for w in words]
    for name, value in options.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is True:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        argv.extend(str(v) for v in values)
    return argv
