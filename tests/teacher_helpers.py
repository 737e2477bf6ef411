"""Helpers for the tests of the offline-teacher pipeline."""

from __future__ import annotations

import dataclasses

from nitrobrew.teacher.extract import Teacher


def interrupted(teacher: Teacher, at_call: int) -> Teacher:
    """``teacher``, killed (KeyboardInterrupt) in its ``at_call``-th forward: an extraction stopped part-way."""
    calls = 0

    def hidden(ids, mask):
        nonlocal calls
        calls += 1
        if calls == at_call:
            raise KeyboardInterrupt
        return teacher.hidden_fn(ids, mask)

    return dataclasses.replace(teacher, hidden_fn=hidden)


def flip_bits(path, offset: int, mask: int = 0xFF) -> bytes:
    """Corrupt the file at ``path`` in place: the byte at ``offset`` XOR ``mask``, the size unchanged. Returns the
    bytes it held before (to write back, or cut short)."""
    with open(path, "rb") as f:
        raw = f.read()
    flipped = bytearray(raw)
    flipped[offset] ^= mask
    with open(path, "wb") as f:
        f.write(bytes(flipped))
    return raw
