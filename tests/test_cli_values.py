"""Numbers llama-server starts with start hydra-trio too, with the same meaning (``common/arg.cpp`` of the
llama.cpp that llama-cpp-python 0.3.36 vendors: what each flag's handler accepts, and what it makes of it)."""

from __future__ import annotations

import os

import pytest

from hydra_trio import cli
from hydra_trio.cli.run import engine_config, llama_options, log_level


def parse(*argv: str):
    return cli.parse_args(list(argv), environ={})


def test_threads_0_or_less_are_every_core() -> None:
    # arg.cpp: n_threads <= 0 -> std::thread::hardware_concurrency(), for -t and -tb alike
    for value in ("0", "-1"):
        args = parse("-t", value, "-tb", value)
        assert engine_config(args, llama_options(args)).n_threads is None  # every core
        assert llama_options(args).n_threads_batch == os.cpu_count()  # every core, not "as -t"
    args = parse("-t", "2")
    assert engine_config(args, llama_options(args)).n_threads == 2 and llama_options(args).n_threads_batch is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--cpu-strict", "2"],
        ["--cpu-strict-batch", "7"],  # std::stoul / int: any value, a truth value
        ["--poll", "200"],
        ["--poll-batch", "5"],  # a polling level, any value
        ["-mg", "-1"],  # llama.cpp: a negative main GPU with -sm none is the CPU; a CPU build ignores it
        ["-fitc", "-5"],
    ],
)
def test_cpu_and_device_numbers_llama_server_takes_parse(argv: list[str]) -> None:
    parse(*argv)


def test_a_negative_verbosity_logs_nothing_but_fatal_errors() -> None:
    # llama-server drops every message above the threshold: below 0, all of them
    assert log_level(parse("-lv", "-1")) == "CRITICAL"
    assert (log_level(parse("-lv", "3")), log_level(parse("-lv", "4"))) == ("INFO", "DEBUG")


def test_sampling_values_past_a_samplers_range_mean_what_they_mean_in_llama_server() -> None:
    s = parse(
        "--temp",
        "-1",
        "--top-k",
        "-7",
        "--top-p",
        "1.5",
        "--min-p",
        "-0.2",
        "--typical",
        "3",
        "--xtc-probability",
        "2",
        "--xtc-threshold",
        "-1",
        "--dry-base",
        "0.5",
    ).sampling
    assert s.temperature == 0.0  # arg.cpp: std::max(temp, 0): greedy
    assert s.top_k == -1  # top_k <= 0: off
    assert (s.top_p, s.typical_p) == (1.0, 1.0)  # p >= 1: off
    assert s.min_p == 0.0  # p <= 0: off
    assert (s.xtc_probability, s.xtc_threshold) == (1.0, 0.0)
    assert s.dry_base == 1.75  # arg.cpp keeps the default for a base below 1


def test_every_value_below_a_floor_means_what_the_floor_means() -> None:
    from hydra_trio.cli.run import engine_config, llama_options

    args = parse("-np", "-5", "-cram", "-7", "-ctxcp", "-1", "--cache-reuse", "-3")
    cfg = engine_config(args, llama_options(args))
    # server.cpp: any negative -np is auto (4 slots, unified KV); a negative --cache-ram is no limit; checkpoints
    # and cache reuse at 0 or less are off
    assert (cfg.n_parallel, cfg.llama.kv_unified) == (4, True)
    assert (cfg.cache_ram_mib, cfg.n_ctx_checkpoints, cfg.n_cache_reuse) == (-1, 0, 0)
