"""A progress bar: tqdm when installed, otherwise a plain line every ~10%."""

from __future__ import annotations

import sys
import time
from typing import Dict, Optional


class Progress:
    def __init__(self, total: int, desc: str, initial: int = 0, enabled: bool = True):
        self.total, self.desc, self.n = total, desc, initial
        self._bar = None
        self._postfix: Dict[str, str] = {}
        self._t0 = time.perf_counter()
        self._next_print = initial
        self.enabled = enabled
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            print(f"{desc}: {initial}/{total}", flush=True)
            self._next_print = initial + max(total // 10, 1)
            return
        self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True, file=sys.stderr)

    def update(self, n: int = 1, **postfix) -> None:
        self.n += n
        if postfix:
            self._postfix = {k: (f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in postfix.items()}
        if not self.enabled:
            return
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(self._postfix, refresh=False)
            self._bar.update(n)
        elif self.n >= self._next_print or self.n >= self.total:
            extra = " ".join(f"{k}={v}" for k, v in self._postfix.items())
            print(
                f"{self.desc}: {self.n}/{self.total} ({time.perf_counter() - self._t0:.0f}s) {extra}".rstrip(),
                flush=True,
            )
            self._next_print = self.n + max(self.total // 10, 1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> Optional[bool]:
        self.close()
        return None
