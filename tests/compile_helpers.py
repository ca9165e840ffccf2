"""Helpers of the CPU tests that compile kernels through NVRTC and read their SASS (no GPU needed): skip where NVRTC
or nvdisasm is missing, and the opcodes of a cubin's SASS."""
from __future__ import annotations

import re

import pytest

from cuflash import _compile
from cuflash.__main__ import sass_text

_OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]+)", re.M)


def nvrtc_or_skip():
    """Skip the test where CuPy or libnvrtc is missing: nothing to compile with."""
    try:
        _compile._nvrtc().getVersion()
    except Exception as e:
        pytest.skip(f"NVRTC is not usable here: {type(e).__name__}: {e}")


def sass_or_skip(cubin: bytes) -> str:
    """The cubin's SASS text; skip the test where nvdisasm is missing."""
    text = sass_text(cubin)
    if text is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    return text


def opcodes(text: str) -> list:
    """The opcode of every SASS instruction (predicate guards dropped), in order."""
    return _OPCODE.findall(text)


def opcode_counter(text: str):
    """A function counting the SASS instructions whose opcode starts with a prefix."""
    ops = opcodes(text)
    return lambda prefix: sum(1 for o in ops if o.startswith(prefix))


_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+`?\(?(\.L_x_\d+)")


def sass_loops(text: str) -> list:
    """The loops of a SASS listing: for every branch back to a label above it, the opcodes from the label to the
    branch (nested loops each appear once, inside their outer loop's list as well)."""
    label_at, lines = {}, []
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            label_at[m.group(1)] = len(lines)
        elif _OPCODE.match(line):
            lines.append(line)
    loops = []
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and label_at.get(m.group(1), i + 1) <= i:
            loops.append([_OPCODE.match(x).group(1) for x in lines[label_at[m.group(1)]:i + 1]])
    return loops
