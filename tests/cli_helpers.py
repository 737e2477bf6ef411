"""Command lines for the CLI tests, written as keywords instead of one list item per word, and the check that
a command line is refused as the CLI refuses: one line on stderr, exit status 2."""

from __future__ import annotations

import pytest

from nitrobrew.cli import main


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


def one_line_exit_2(argv, capsys) -> str:
    """Run the console script on argv; it must exit with status 2 and one line on stderr (no usage block),
    which is returned."""
    capsys.readouterr()  # what earlier calls printed
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err, err
    return err.strip()
