"""`python -m cuflash.check`, the sanitizer runner: its case set, sharding and log parsing (no GPU needed)."""
from __future__ import annotations

import json

from cuflash import check, config

CLEAN_LOG = """\
/usr/local/cuda/bin/compute-sanitizer --tool memcheck ...
========= COMPUTE-SANITIZER
CASE 1/2 d64-fp16-causal-113x203-b1h2-bshd-padded
RESULT {"case": "a", "seconds": 0.1, "digests": {"o": "1"}, "problems": []}
CASE 2/2 d128-bf16-full-1023x17-b2h1-bhsd-transposed
RESULT {"case": "b", "seconds": 0.1, "digests": {"o": "2"}, "problems": []}
DRIVER DONE 2 cases, 0 with problems
========= ERROR SUMMARY: 0 errors
"""

MEMCHECK_ERROR_LOG = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at cuflash::fwd_kernel<...>+0x1a40
=========     by thread (3,0,0) in block (0,1,0)
=========     Address 0x7f0000001000 is out of bounds
=========
RESULT {"case": "a", "seconds": 0.1, "digests": {"o": "1"}, "problems": []}
DRIVER DONE 1 cases, 0 with problems
========= ERROR SUMMARY: 1 error
"""

RACECHECK_LOG = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at bwd_kernel+0x100
=========     and Read access at bwd_kernel+0x200 [64 hazards]
DRIVER DONE 0 cases, 0 with problems
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 2 warnings)
"""


def test_default_cases_cover_every_shipped_instantiation():
    """Each case runs forward, both backward modes, so the set, run once per kernel family (wgmma by
    default on sm_90a, and CUFLASH_KERNELS=mma), must launch every config the library has."""
    launched = {cfg for case in check.default_cases() for kernels in config.KERNEL_FAMILIES
                for cfg in case.configs(kernels=kernels)}
    shipped = set(config.all_fwd_configs()) | set(config.all_bwd_configs())
    assert shipped <= launched, f"never launched under the sanitizers: {sorted(map(str, shipped - launched))}"


def test_cases_have_the_required_variety():
    cases = check.default_cases()
    assert {c.kernel_head_dim for c in cases} == set(config.KERNEL_HEAD_DIMS)
    assert any(c.head_dim not in config.KERNEL_HEAD_DIMS for c in cases)  # a zero-padded head dim
    assert {c.dtype for c in cases} == {"fp16", "bf16"} and {c.causal for c in cases} == {False, True}
    assert {c.layout for c in cases} == {"bshd", "bhsd"} and set(check.STRIDES) <= {c.strides for c in cases}
    seqlens = {c.seqlen_q for c in cases} | {c.seqlen_k for c in cases}
    assert {1, 17, 113, 1023} <= seqlens
    assert any(c.seqlen_q > c.seqlen_k and c.causal for c in cases)  # rows that see no key
    assert any(c.seqlen_q < c.seqlen_k and c.causal for c in cases)
    assert len({c.name for c in cases}) == len(cases)
    # sanitizers are slow: tiny problems (a few more heads where GQA, varlen batches or kv caches need them)
    assert max(c.batch * c.heads for c in cases if c.kind == "dense" and c.heads_kv == c.heads) <= 2
    assert max(c.batch * c.heads * max(c.seqlen_q, c.seqlen_k) for c in cases) <= 4 * 1024
    # the features: grouped-query (incl. multi-query) heads, packed sequences, kv caches dense and paged,
    # with and without split-KV
    assert {c.heads // c.heads_kv for c in cases} >= {1, 2, 4}
    assert {c.kind for c in cases} == set(check.KINDS)
    kv = [c for c in cases if c.kind == "kvcache"]
    assert {c.paged for c in kv} == {False, True} and {c.splits for c in kv} >= {0, 1, 3}


def test_shards_balance_cost_and_cover_each_case_once():
    cases = check.default_cases()
    shards = check.shard(cases, list(range(len(cases))), 5)
    assert sorted(i for s in shards for i in s) == list(range(len(cases)))
    loads = [sum(cases[i].cost for i in s) for s in shards]
    assert max(loads) <= 1.5 * min(loads)
    assert check.shard(cases, [3], 4) == [[3]]


def test_parse_clean_log():
    parsed = check.parse_log(CLEAN_LOG)
    assert parsed["errors"] == 0 and parsed["done"] and not parsed["findings"]
    assert [r["case"] for r in parsed["results"]] == ["a", "b"]


def test_parse_memcheck_error_keeps_the_report():
    parsed = check.parse_log(MEMCHECK_ERROR_LOG)
    assert parsed["errors"] == 1
    assert any("Invalid __global__ read" in line for line in parsed["findings"])
    assert any("out of bounds" in line for line in parsed["findings"])


def test_parse_racecheck_summary_counts_errors_and_warnings():
    parsed = check.parse_log(RACECHECK_LOG)
    assert parsed["race_errors"] == 1 and parsed["race_warnings"] == 2 and parsed.get("race_summary")
    assert any("Race reported" in line for line in parsed["findings"])


def test_tool_options_only_use_flags_the_sanitizer_lists():
    help_text = "--error-exitcode <number>\n--print-limit <number>\n--racecheck-report <mode>\n"
    assert check.tool_options("racecheck", help_text) == ["--error-exitcode", "99", "--print-limit", "200",
                                                          "--racecheck-report", "all"]
    assert check.tool_options("memcheck", "") == ["--error-exitcode", "99"]
    full = help_text + "--padding <n>\n--launch-timeout <n>\n--racecheck-memcpy-async <yes|no>\n--report-api-errors\n"
    assert "--padding" in check.tool_options("memcheck", full)
    assert check.tool_options("racecheck", full)[-2:] == ["--racecheck-memcpy-async", "yes"]
    assert "--report-api-errors" in check.tool_options("synccheck", full)
    assert "--padding" not in check.tool_options("initcheck", full)


def test_driver_command_and_case_listing(capsys):
    cmd = check._driver_cmd("quick", [0, 2], verify=True)
    assert cmd[1:] == ["-m", "cuflash.check", "_driver", "--case-set", "quick", "--cases", "0,2", "--verify"]
    assert check.main(["cases", "--quick"]) == 0
    out = capsys.readouterr().out
    assert f"{len(check.quick_cases())} cases" in out
    json.dumps([c.name for c in check.default_cases()])
