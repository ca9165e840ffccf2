"""Plans: what the first call of a signature worked out, replayed by every later call of that signature.

The host path of a call has four layers (cuflash/):

    api.py        the public functions: arguments and docstrings
    _problem.py   a call's validated description: shapes, strides, dtype, layout, score modifiers
    _families.py  the plan: kernel family and config (config.select), launch arguments, launches
    _launch.py    loading kernels and launching them

A warm call skips the middle two. Its key (`Signature.key`) holds everything that decides validation and launch
except the array addresses: per array (shape, byte strides, dtype, device), every option with its type (True == 1,
but causal=1 is an error), and the kernel families in use (CUFLASH_KERNELS). When the key finds a `Plan`, `replay`
checks what depends on addresses (16-byte alignment, which decides a copy; overlap of arrays a launch writes in
place with the others), allocates the outputs and the workspace, writes the addresses into the recorded launch
arguments and launches. When a check fails, the call takes the full path, which copies or raises exactly as
without a plan. Plans are made only for calls that launch on their arguments in place (no copy). The score
modifiers that are values (a window, the softcap, the dropout probability) enter the key; the ALiBi slopes, a bias,
a boolean mask and a key_padding_mask are arrays like the others (their addresses are written per call; with both
masks their intersection is made per call, as the full path makes it); a BlockMask enters the key by its identity
(its contents decided the kernels and its tile maps, so the plan replays for that object only); the dropout seed and
offset enter by their types and are range-checked and written per call (BOUND); dbias=True allocates the gradient
per call and a preallocated dbias is an array of the plan (each zeroed where the kernels add into it); FP8 descales
are arrays of the plan, or numbers that enter the key by value.
"""
from __future__ import annotations

import numbers
import threading
import weakref
from typing import NamedTuple

from . import _launch, _validate, config
from .blockmask import BlockMask


class PlanCache:
    """Plans by key, at most `size` of them (the oldest goes first); thread-safe."""

    def __init__(self, size: int = 512):
        self.size = size
        self._plans: dict = {}
        self._lock = threading.Lock()

    def get(self, key):
        """The plan of key, or None (no key: arguments that are not all CuPy arrays; an unhashable option;
        a plan whose kernels came from an in-memory kernel table that has since been replaced)."""
        if key is None:
            return None
        try:
            plan = self._plans.get(key)
        except TypeError:  # an unhashable option (a list as softmax_scale, ...): the full path reports it
            return None
        if plan is None or plan.kernels is not _launch._kernels:
            return None
        return plan

    def put(self, key, plan) -> None:
        try:
            hash(key)
        except TypeError:  # an unhashable option that the full path accepts (a window given as a list): no plan
            return
        with self._lock:
            if len(self._plans) >= self.size:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


plans = PlanCache()


# --- keys ------------------------------------------------------------------------------------------------

ARRAY, OPTIONAL_ARRAY, COUNT, OPTION, BOUND, FLAG_OR_ARRAY, NUMBER_OR_ARRAY, MASK, DEFAULT = (
    "array", "optional array", "count", "option", "bound", "flag or array", "number or array", "mask", "default")


class Signature:
    """The plan key of one public function's calls.

    `params` lists the function's arguments in order, each (name, kind): ARRAY (a CuPy array: its shape,
    strides, dtype and device enter the key), OPTIONAL_ARRAY (None or an array), COUNT (None, an int that enters
    by its type only because its value is bound per call, or an array), OPTION (value and type enter the key),
    BOUND (None or an int that the plan range-checks and writes into the launch arguments on every call, e.g. the
    dropout seed: its type enters the key, its value is passed to `replay` in `extra`), FLAG_OR_ARRAY (True or False,
    which enter the key, or an array: e.g. dbias, a flag or a preallocated gradient), NUMBER_OR_ARRAY (None, an int or
    float that enters the key by type and value, or an array: e.g. an FP8 descale), MASK (None, an array, or a
    BlockMask, which enters the key by its identity: the plan keeps a weak reference to it and replays only for that
    object, see `Plan.guards`), DEFAULT (the call is planned only when it has the value in `defaults`; it does not
    enter the key). `exclusive` lists groups of optional arguments of which a planned call gives at most one: a call
    that gives two of one group gets no key.

    `key(*args)` is generated once as one flat tuple expression: a loop over the arguments building the same
    tuple cost ~0.7 us more per call (tools/launch_overhead.py --fake, 2026-11-24), and a tuple of per-array
    tuples ~1 us more to build, hash and compare."""

    def __init__(self, name: str, params, defaults: dict | None = None, exclusive=()):
        self.name = name
        self.params = tuple(params)
        self.defaults = dict(defaults or {})
        self.exclusive = tuple(tuple(group) for group in exclusive)
        names = [n for n, _ in self.params]
        checks, parts, plain = [], [repr(name), "_config.KERNELS"], []
        for group in self.exclusive:
            if len(group) < 2 or any(n not in names for n in group):
                raise ValueError(f"{name}: exclusive group {group!r} must name two or more of its parameters")
            checks.append(f"    if {' + '.join(f'({n} is not None)' for n in group)} > 1:\n        return None")
        arrays = [n for n, kind in self.params if kind == ARRAY]
        if arrays:
            checks.append(f"    if {' or '.join(f'type({n}) is not nd' for n in arrays)}:\n        return None")
        for n, kind in self.params:
            meta = f"{n}.shape, {n}.strides, {n}.dtype, {n}.data.device_id"
            if kind == ARRAY:
                parts.append(meta)
            elif kind == OPTIONAL_ARRAY:
                checks.append(f"    if {n} is not None and type({n}) is not nd:\n        return None")
                parts.append(f"None if {n} is None else ({meta})")
            elif kind == COUNT:
                checks.append(f"    if {n} is None or isinstance({n}, Integral):\n        {n}_key = type({n})\n"
                              f"    elif type({n}) is nd:\n        {n}_key = ({meta})\n    else:\n        return None")
                parts.append(f"{n}_key")
            elif kind == OPTION:
                parts.append(f"type({n}), {n}")
            elif kind == BOUND:
                parts.append(f"type({n})")
            elif kind == FLAG_OR_ARRAY:
                checks.append(f"    if type({n}) is bool:\n        {n}_key = {n}\n"
                              f"    elif type({n}) is nd:\n        {n}_key = ({meta})\n    else:\n        return None")
                parts.append(f"{n}_key")
            elif kind == NUMBER_OR_ARRAY:
                checks.append(f"    if {n} is None:\n        {n}_key = None\n"
                              f"    elif type({n}) is nd:\n        {n}_key = ({meta})\n"
                              f"    elif type({n}) is int or type({n}) is float:\n        {n}_key = (type({n}), {n})\n"
                              f"    else:\n        return None")
                parts.append(f"{n}_key")
            elif kind == MASK:
                checks.append(f"    if {n} is None:\n        {n}_key = None\n"
                              f"    elif type({n}) is nd:\n        {n}_key = ({meta})\n"
                              f"    elif type({n}) is BlockMask:\n        {n}_key = (BlockMask, id({n}))\n"
                              f"    else:\n        return None")
                parts.append(f"{n}_key")
            elif kind == DEFAULT:
                d = self.defaults[n]
                plain.append(f"{n} is {d!r}" if d is None or type(d) is bool else
                             f"type({n}) is {type(d).__name__} and {n} == {d!r}")
            else:
                raise ValueError(f"{name}: parameter {n!r} has kind {kind!r}")
        if plain:
            checks.append(f"    if not ({' and '.join(plain)}):\n        return None")
        src = (f"def key({', '.join(names)}):\n    nd = _validate._ndarray\n" + "\n".join(checks)
               + f"\n    return ({', '.join(parts)})\n")
        scope = {"_validate": _validate, "_config": config, "Integral": numbers.Integral, "BlockMask": BlockMask}
        exec(src, scope)  # noqa: S102 - our own text, built from the parameter list above
        self.key = scope["key"]
        self.key.__qualname__ = f"Signature({name!r}).key"
        self.source = src


# --- plans and their replay ------------------------------------------------------------------------------

class Plan(NamedTuple):
    """The launches of one call signature. Arrays are numbered as the public function passes them to `replay`,
    then the arrays a replay allocates (`allocs`), in order."""

    device: int
    arrays: int  # how many arrays the public function passes (None where an optional one is absent)
    aligned: tuple  # array numbers whose address must be a multiple of 16 (else the full path copies them)
    writes: tuple  # array numbers the launches write in place (preallocated outputs, a KV cache)
    extents: tuple  # per array: its byte range relative to its address (needed only with writes), or None
    binds: tuple  # (array number, template, word): the array's address goes into that word of that block
    allocs: tuple  # (shape, dtype, ((template, word), ...), zeroed) of each array a call allocates
    workspace: tuple | None  # (float32 elements, ((template, word, byte offset), ...)): one scratch array
    launches: tuple  # (kernel, grid, template) in launch order
    templates: tuple  # _launch.ArgsTemplate of each distinct params struct
    returns: object  # an array number, or a tuple of them: what the call returns
    step: object  # None, or a family's per-call step for values outside the key (see `replay`)
    kernels: dict  # the kernel table the kernels came from
    derived: tuple = ()  # (array numbers, template, word, fn): fn(their addresses) gives words written from there
    #                      on (the TMA forward's tensor maps, which hold the addresses)
    streamed: tuple = ()  # (template, word, fn): fn(the call's stream) gives that word (a per-stream buffer's address)
    values: tuple = ()  # (index in extra, limit, ((template, field path), ...)): an int value of the call (None: 0),
    #                     checked to be in [0, limit) (else the full path), written into those fields
    guards: tuple = ()  # (array number, weak reference): the plan replays only for that very BlockMask (the launch
    #                     arguments hold its mask's and tile maps' addresses, and its contents chose the kernels)
    made: tuple = ()  # (fn, array numbers, ((template, word), ...)): fn(those arrays) makes an array per call (the
    #                   intersection of a mask and a key_padding_mask) whose address goes into those words
    cleared: tuple = ()  # array numbers filled with zeros before the launches (a preallocated dbias added into)
    held: tuple = ()  # objects kept alive with the plan (arrays whose addresses its launch arguments hold)
    run: object = None  # run(arrays, extra): the replay made for this plan (`PlanBuilder.plan` sets it)


def replay(plan: Plan, arrays: tuple, extra=None):
    """The plan's launches on these arrays: what the call returns, or None when a per-call check fails (the full
    path then copies, or raises exactly as without a plan).

    Per call: the array addresses; their alignment and, with writes, overlap checks; the outputs and the workspace
    allocated; every address, and what derives from addresses (plan.derived), written into this thread's argument
    blocks; the launches. plan.step, when a family has one, runs after the allocations and before anything is
    written or launched: step(plan, arrays, extra, blocks, stream) sets the per-call values of the argument blocks
    (blocks[t] = (params, address, words)) and returns (launches, keep) (keep: what must live until the launches
    are queued), or None to take the full path. Families without a step take the values of their BOUND arguments
    in extra (plan.values), each checked before anything is allocated.

    The plan runs these steps as straight-line code made once per plan (`_replay_code`): the same steps as loops
    over the plan's tuples cost ~1 us more per call (tools/launch_overhead.py --fake, 2026-11-24)."""
    return plan.run(arrays, extra)


def _replay_code(plan: Plan) -> str:
    """The text of `run(arrays, extra)` for a plan: `replay` unrolled over its arrays, allocations and launches."""
    n = plan.arrays
    lines = ["def run(arrays, extra):"]
    names = [f"a{i}" for i in range(n)]
    lines.append(f"    {', '.join(names)}{',' if n == 1 else ''} = arrays")
    for j, (i, _) in enumerate(plan.guards):
        lines.append(f"    if a{i} is not GUARDS[{j}][1]():\n        return None")
    bound = {i for i, _, _ in plan.binds} | set(plan.aligned) | set(plan.writes) | \
        {i for arrays, _, _, _ in plan.derived for i in arrays}
    if plan.writes:  # every array with an extent is checked against the written ones
        bound |= {i for i, e in enumerate(plan.extents) if e is not None}
    guarded = {i for i, _ in plan.guards}
    for i in sorted(bound):
        required = i in plan.aligned
        if i in guarded:  # a BlockMask: its mask's address
            lines.append(f"    p{i} = a{i}.mask.data.ptr")
        elif required:
            lines.append(f"    p{i} = a{i}.data.ptr")
        else:
            lines.append(f"    p{i} = 0 if a{i} is None else a{i}.data.ptr")
    if plan.aligned:
        lines.append(f"    if ({' | '.join(f'p{i}' for i in plan.aligned)}) & 15:\n        return None")
    if plan.writes:
        ptrs = ", ".join(f"p{i}" if i in bound else "0" for i in range(n))
        lines.append(f"    if _writes_overlap(PLAN, ({ptrs},)):\n        return None")
    for j, (index, limit, _) in enumerate(plan.values):  # (bool is not int: True goes the full path, which refuses it)
        lines.append(f"    e{j} = extra[{index}]")
        lines.append(f"    if e{j} is None:\n        e{j} = 0\n"
                     f"    elif type(e{j}) is not int or not 0 <= e{j} < {limit}:\n        return None")
    lines.append("    cp = _launch.cupy()")
    lines.append("    with _launch.on_device(cp, PLAN.device):")
    for t in range(len(plan.templates)):
        lines.append(f"        blk{t} = TEMPLATES[{t}].mine()")
        lines.append(f"        w{t} = blk{t}[2]")
    for j, (_, _, slots, zeroed) in enumerate(plan.allocs):
        x = f"x{n + j}"
        lines.append(f"        {x} = cp.{'zeros' if zeroed else 'empty'}(ALLOCS[{j}][0], dtype=ALLOCS[{j}][1])")
        for t, word in slots:
            lines.append(f"        w{t}[{word}] = {x}.data.ptr")
    lines.append("        stream = cp.cuda.get_current_stream().ptr")
    for j, (t, word, _) in enumerate(plan.streamed):
        lines.append(f"        w{t}[{word}] = STREAMED[{j}][2](stream)")
    if plan.step is not None:
        blocks = ", ".join(f"blk{t}" for t in range(len(plan.templates)))
        lines.append(f"        stepped = PLAN.step(PLAN, arrays, extra, [{blocks}], stream)")
        lines.append("        if stepped is None:\n            return None")
        lines.append("        launches, keep = stepped")
    for i, t, word in plan.binds:
        lines.append(f"        w{t}[{word}] = p{i}")
    for j, (_, _, targets) in enumerate(plan.values):
        for t, path in targets:
            lines.append(f"        blk{t}[0].{path} = e{j}")
    for i in plan.cleared:
        lines.append(f"        a{i}.fill(0)")
    for j, (arrays, t, word, _) in enumerate(plan.derived):
        lines.append(f"        words = DERIVED[{j}][3](({''.join(f'p{i}, ' for i in arrays)}))")
        lines.append(f"        w{t}[{word}:{word} + len(words)] = words")
    if plan.workspace is not None:
        lines.append("        work = cp.empty(PLAN.workspace[0], dtype=cp.float32)")
        for t, word, offset in plan.workspace[1]:
            lines.append(f"        w{t}[{word}] = work.data.ptr + {offset}")
    for j, (_, arrays, words) in enumerate(plan.made):  # (after the workspace, as the full path makes them)
        lines.append(f"        m{j} = MADE[{j}][0]({', '.join(f'a{i}' for i in arrays)})")
        for t, word in words:
            lines.append(f"        w{t}[{word}] = m{j}.data.ptr")
    if plan.step is not None:
        lines.append("        for kernel, grid, t in launches:")
        blocks = ", ".join(f"blk{t}[1]" for t in range(len(plan.templates)))
        lines.append(f"            kernel.launch_at(grid, ({blocks},)[t], stream)")
    else:
        for j, (_, _, t) in enumerate(plan.launches):
            lines.append(f"        LAUNCHES[{j}][0].launch_at(LAUNCHES[{j}][1], blk{t}[1], stream)")
    r = plan.returns
    value = (lambda i: f"a{i}" if i < n else f"x{i}")
    lines.append(f"    return {value(r)}" if type(r) is int else f"    return ({', '.join(map(value, r))},)")
    return "\n".join(lines) + "\n"


def _compile_replay(plan: Plan):
    src = _replay_code(plan)
    scope = {"_launch": _launch, "_writes_overlap": _writes_overlap, "TEMPLATES": plan.templates,
             "ALLOCS": plan.allocs, "LAUNCHES": plan.launches, "DERIVED": plan.derived, "STREAMED": plan.streamed,
             "GUARDS": plan.guards, "MADE": plan.made}
    exec(src, scope)  # noqa: S102 - our own text, built from the plan's tuples
    return scope, src


def _writes_overlap(plan: Plan, ptrs: list) -> bool:
    """Whether an array the launches write meets another array of the call (addresses from ptrs)."""
    extents = plan.extents
    for w in plan.writes:
        lo, hi = extents[w]
        a0, a1 = ptrs[w] + lo, ptrs[w] + hi
        for j, ext in enumerate(extents):
            if j != w and ext is not None and a0 < ptrs[j] + ext[1] and ptrs[j] + ext[0] < a1:
                return True
    return False


def relative_extent(info: _validate.ArrayInfo) -> tuple:
    """An array's byte range as offsets from its address (they do not depend on the address)."""
    a0, a1 = _validate.byte_extent(info)
    return a0 - info.ptr, a1 - info.ptr


class PlanBuilder:
    """Collects a plan while a family's full path launches: its argument templates, the words their array
    addresses go to, the allocations and the launches. `plan(...)` returns the Plan."""

    def __init__(self, device: int, arrays: int):
        self.device, self.arrays = device, arrays
        self.params: list = []  # the params structs, made templates when the plan is complete
        self._index: dict = {}
        self.binds: list = []
        self.allocs: list = []
        self.workspace = None
        self.launches: list = []
        self.derived: list = []
        self.streamed: list = []
        self.values: list = []
        self.guards: list = []
        self.made: list = []
        self.cleared: list = []
        self.held: list = []

    def template(self, params) -> int:
        """The number of this params struct's template (recorded from the struct as it is when `plan` is called)."""
        n = self._index.get(id(params))
        if n is None:
            n = self._index[id(params)] = len(self.params)
            self.params.append(params)
        return n

    def bind(self, array_number: int, params, *fields: str) -> None:
        """The array's address goes into these pointer fields of params."""
        t = self.template(params)
        for f in fields:
            self.binds.append((array_number, t, _launch.field_word(type(params), f)))

    def alloc(self, shape, dtype, *targets, zeroed: bool = False) -> None:
        """An array allocated per call (zeroed: filled with zeros first, on the call's stream); targets: (params,
        field) pairs its address goes to."""
        self.allocs.append((tuple(shape), dtype, tuple((self.template(p), _launch.field_word(type(p), f))
                                                       for p, f in targets), bool(zeroed)))

    def scratch(self, floats: int, *targets) -> None:
        """One float32 workspace per call; targets: (params, field, byte offset) triples."""
        self.workspace = (floats, tuple((self.template(p), _launch.field_word(type(p), f), off)
                                        for p, f, off in targets))

    def derive(self, array_numbers: tuple, params, field: str, fn) -> None:
        """Words from `field` of params on are fn((addresses of these arrays)) on every call (a memoryview of 8-byte
        words, e.g. tensor maps that hold the addresses)."""
        self.derived.append((tuple(array_numbers), self.template(params), _launch.field_span(type(params), field)[0],
                             fn))

    def per_stream(self, params, field: str, fn) -> None:
        """The pointer field of params is fn(the call's stream) on every call (a buffer kept per stream)."""
        self.streamed.append((self.template(params), _launch.field_word(type(params), field), fn))

    def value(self, index: int, limit: int, *targets) -> None:
        """The call's BOUND value extra[index] (None or an int in [0, limit), else the full path) goes into these
        (params, field path) targets on every call (none: it is only checked)."""
        for _, path in targets:
            if not all(name.isidentifier() for name in path.split(".")):
                raise ValueError(f"field path {path!r}")
        self.values.append((index, int(limit), tuple((self.template(p), path) for p, path in targets)))

    def guard(self, array_number: int, obj) -> None:
        """The plan replays only when that argument is the BlockMask obj itself (held by a weak reference: a plan does
        not keep it alive, and one made later at the same address is not taken for it)."""
        self.guards.append((array_number, weakref.ref(obj)))

    def make(self, fn, array_numbers: tuple, *targets) -> None:
        """Per call, fn(the arrays of these numbers) makes an array (on the call's device and stream) whose address
        goes into these (params, field) targets; it lives until the launches are queued."""
        self.made.append((fn, tuple(array_numbers), tuple((self.template(p), _launch.field_word(type(p), f))
                                                          for p, f in targets)))

    def clear(self, array_number: int) -> None:
        """The argument (a preallocated output the kernels add into) is filled with zeros before the launches."""
        self.cleared.append(array_number)

    def hold(self, obj) -> None:
        """obj lives as long as the plan (an array whose address the launch arguments hold)."""
        self.held.append(obj)

    def launch(self, kernel, grid, params) -> None:
        self.launches.append((kernel, tuple(grid), self.template(params)))

    def plan(self, *, aligned=(), writes=(), extents=(), returns, step=None) -> Plan:
        plan = Plan(self.device, self.arrays, tuple(aligned), tuple(writes), tuple(extents), tuple(self.binds), tuple(self.allocs),
                    self.workspace, tuple(self.launches), tuple(_launch.ArgsTemplate(p) for p in self.params), returns,
                    step, _launch._kernels, tuple(self.derived), tuple(self.streamed), tuple(self.values),
                    tuple(self.guards), tuple(self.made), tuple(self.cleared), tuple(self.held))
        scope, _ = _compile_replay(plan)
        plan = plan._replace(run=scope["run"])
        scope["PLAN"] = plan
        return plan
