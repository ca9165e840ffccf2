"""The benchmark's timing loop (median_ms) with recording fake events (no GPU), and its GPU hold (on a GPU)."""
from __future__ import annotations

import time

import pytest

from cuflash import bench


class LoggingEvents:
    """Events that log what median_ms does; pair k (in creation order, the probe first) times 1 + (k % 5) ms."""

    def __init__(self):
        self.log, self.made = [], 0

    def event(self):
        self.made += 1
        return self.made - 1

    def record(self, e):
        self.log.append(("record", e))

    def elapsed_ms(self, a, b):
        assert b == a + 1
        return 1.0 + (a // 2) % 5

    def synchronize(self, e):
        self.log.append(("sync", e))

    def hold(self, seconds):
        self.log.append(("hold", seconds))


class ShortEvents(LoggingEvents):
    """Pair k times (1 + k % 5) * 0.1 ms: calls shorter than their host path."""

    def elapsed_ms(self, a, b):
        return 0.1 * super().elapsed_ms(a, b)


@pytest.mark.parametrize("host_bound", [True, False])
def test_timed_calls_run_in_batches_behind_holds_each_between_its_own_events(host_bound):
    """The probe call and the first batch wait behind holds of the host's launch time; later batches of calls
    shorter than their host path (the probe: 0.1 ms of GPU time for 0.2 ms of host time) behind holds of the host's
    lead over the GPU, and of longer calls (1 ms) behind none, so the GPU never idles between batches."""
    events, calls = (ShortEvents() if host_bound else LoggingEvents()), []
    host_s = 200e-6

    def call(i):
        calls.append(i)
        events.log.append(("call", i))
        time.sleep(host_s)

    reps, warmup, n_sets = 70, 3, 4
    t0 = time.perf_counter()
    ms = bench.median_ms(call, n_sets, events, reps, warmup)
    assert time.perf_counter() - t0 >= bench.WARMUP_MIN_S
    # warm-up: rounds of `warmup` calls, each round closed by a synchronize, until WARMUP_MIN_S has passed
    last_sync = len(events.log) - 1 - events.log[::-1].index(("sync", 1))  # the probe's
    warm = events.log[:last_sync - 4]  # ... hold, record(0), call, record(1), sync(1)
    assert events.log[last_sync - 4][0] == "hold" and events.log[last_sync - 4][1] >= 2 * host_s
    rounds = [k for k, entry in enumerate(warm) if entry == ("sync", 1)]
    assert len(rounds) >= 2 and rounds[-1] == len(warm) - 1
    for begin, end in zip([-1] + rounds[:-1], rounds):
        assert [e[0] for e in warm[begin + 1:end]] == ["call"] * warmup + ["record"]
    done = warmup * len(rounds)
    assert calls[:done + 1] == [k % n_sets for k in range(done + 1)]  # warm-up, then the probe
    assert events.log[last_sync - 3:last_sync + 1] == [("record", 0), ("call", done % n_sets), ("record", 1),
                                                       ("sync", 1)]
    timed = events.log[last_sync + 1:]
    holds = [k for k, entry in enumerate(timed) if entry[0] == "hold"]
    batches = [bench.HOLD_BATCH] * (reps // bench.HOLD_BATCH) + [reps % bench.HOLD_BATCH]  # 32, 32, 6
    assert holds[0] == 0 and len(holds) == (len(batches) if host_bound else 1)
    assert timed[0][1] >= 2 * host_s * batches[0]  # long enough for the host to queue the whole batch
    i, k = 0, 1
    for size in batches:
        if host_bound and i:  # the host's lead over the GPU: at least (0.2 - 0.1) ms a call, twice
            assert timed[k - 1][0] == "hold" and timed[k - 1][1] >= 2 * (host_s - 1e-4) * size
            assert timed[k - 1][1] < timed[0][1] * size / batches[0]  # shorter than the host's whole launch time
        for _ in range(size):  # record(start), call, record(stop): pair 1 + i (pair 0 is the probe)
            start = 2 * (1 + i)
            assert timed[k:k + 3] == [("record", start), ("call", i % n_sets), ("record", start + 1)]
            i, k = i + 1, k + 3
        k += host_bound  # the next batch's hold
    assert i == reps and timed[-1] == ("sync", 2 * reps + 1)
    expected = sorted((1.0 + k % 5) * (0.1 if host_bound else 1) for k in range(1, reps + 1))[reps // 2]
    assert ms == pytest.approx(expected)


def test_reps_shrink_to_the_time_budget_but_not_below_the_minimum():
    class Slow(LoggingEvents):
        def elapsed_ms(self, a, b):
            return 400.0  # 0.4 s a call: the 1 s budget allows 2, the minimum is MIN_REPS

    events = Slow()
    bench.median_ms(lambda i: None, 1, events, 100, 1)
    timed_records = [e for kind, e in events.log if kind == "record" and e >= 2]  # events 0 and 1: the probe
    assert len(timed_records) == 2 * bench.MIN_REPS


def test_sustain_raises_the_warm_up_floor_and_the_timed_span(monkeypatch):
    monkeypatch.setattr(bench, "sustain_s", 0.3)
    events, calls = LoggingEvents(), []
    t0 = time.perf_counter()
    bench.median_ms(lambda i: calls.append(i), 1, events, 10, 3)
    assert time.perf_counter() - t0 >= 0.3
    timed = [e for kind, e in events.log if kind == "record" and e >= 2]  # events 0 and 1: the probe (1 ms)
    assert len(timed) == 2 * 300  # 0.3 s of 1 ms calls, not --reps 10
    monkeypatch.setattr(bench, "MAX_REPS", 50)  # below the 300 calls that 0.3 s asks for
    events = LoggingEvents()
    bench.median_ms(lambda i: None, 1, events, 10, 3)
    assert len([e for kind, e in events.log if kind == "record" and e >= 2]) == 2 * bench.MAX_REPS


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_sustain_must_be_a_positive_number_of_seconds(value, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--sustain", value])
    assert "--sustain" in capsys.readouterr().err


def _elapsed_ms_of_hold(stream, stream_ptr, seconds):
    import cupy as cp

    with stream:
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
    bench.hold_stream(stream_ptr, seconds)
    with stream:
        b.record()
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b)


@pytest.mark.gpu
def test_hold_keeps_the_current_stream_and_another_busy_for_its_time_and_no_longer_than_the_cap():
    import cupy as cp

    current = cp.cuda.get_current_stream()
    other = cp.cuda.Stream(non_blocking=True)  # launched through Stream.from_external / ExternalStream
    for stream in (current, other):  # compile and load the hold kernel, wrap the stream: outside the timing
        _elapsed_ms_of_hold(stream, stream.ptr, 0.0)
    for stream in (current, other):
        ms = _elapsed_ms_of_hold(stream, stream.ptr, 0.005)
        assert 4.9 <= ms < 30, (stream, ms)
    ms = _elapsed_ms_of_hold(current, current.ptr, 10.0)
    assert bench.HOLD_MAX_S * 1e3 - 0.1 <= ms < bench.HOLD_MAX_S * 1e3 + 30, ms


@pytest.mark.gpu
def test_a_short_kernel_is_timed_as_gpu_work_not_as_the_host_path():
    import cupy as cp

    spin = cp.RawKernel(bench._HOLD_SOURCE, "cuflash_bench_hold")

    def call(i):  # 20 us of GPU work behind ~1 ms of host time per call
        time.sleep(1e-3)
        spin((1,), (1,), (cp.uint64(20_000),))

    ms = bench.median_ms(call, 1, bench.CupyEvents(), 40, 2)
    assert 0.019 <= ms < 0.2  # without the hold, each call's events would span the host's ~1 ms


@pytest.mark.gpu
def test_calls_longer_than_their_host_path_run_back_to_back_after_the_first_hold():
    import cupy as cp

    spin = cp.RawKernel(bench._HOLD_SOURCE, "cuflash_bench_hold")
    made = []

    class Kept(bench.CupyEvents):  # keeps the timed events, to read the span of the whole timed phase
        def event(self):
            made.append(super().event())
            return made[-1]

    def call(i):  # 1 ms of GPU work behind ~0.3 ms of host time per call
        time.sleep(3e-4)
        spin((1,), (1,), (cp.uint64(1_000_000),))

    reps = 3 * bench.HOLD_BATCH
    ms = bench.median_ms(call, 1, Kept(), reps, 2)
    assert 0.99 <= ms < 1.2
    first, last = made[2], made[-1]  # made[0:2]: the probe's pair
    span = cp.cuda.get_elapsed_time(first, last)
    # back to back: no hold between batches (each would idle the GPU for ~2 * 32 * 0.3 ms = 19 ms)
    assert span < reps * ms + 5, (span, reps * ms)
