"""The speculative-decoding command line: every ``--spec-*`` / ``--draft*`` / ``-md`` / ``-lcs`` flag of
llama-server's (``common/arg.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors) and hydra-trio's
``--spec-suffix-*`` parse with llama-server's value syntax and land in ``EngineConfig.speculative``; their
``LLAMA_ARG_*`` variables set them (a flag wins); a wrong value exits 2 with llama-server's message; what the
node cannot serve is refused at parse time, naming why.  The cases are generated from ``SPEC_OPTIONS``, so a
new option without a case fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hydra_trio import cli
from hydra_trio.cli import RUN_FLAGS
from hydra_trio.cli._flags import OWN, REFUSED, WIRED
from hydra_trio.cli.run import engine_config, llama_options
from hydra_trio.engine.speculative.reasons import UNSUPPORTED
from hydra_trio.engine.speculative.settings import SPEC_OPTIONS, SpecSettings
from hydra_trio.models.presets import PresetError, resolve_model

from .conftest import ROOT, free_port
from .test_cli_flags import launcher_argv

BY_NAME = {n: f for f in RUN_FLAGS for n in f.all_names}
DRAFT_PRESET = "smollm2-135m"  # a preset resolves as -m does (the test pair is -m smollm2-135m -md smollm2-135m-q8)

# field -> (a sample value, what llama-server makes of it); every value differs from the default
SAMPLE: dict[str, tuple[str, object]] = {
    "lookup_cache_static": ("static.bin", "static.bin"),
    "lookup_cache_dynamic": ("dynamic.bin", "dynamic.bin"),
    "draft_threads": ("3", 3),
    "draft_threads_batch": ("5", 5),
    "draft_cpu_mask": ("ff", "ff"),
    "draft_cpu_range": ("0-1", "0-1"),
    "draft_cpu_strict": ("1", 1),
    "draft_prio": ("2", 2),
    "draft_poll": ("0", 0),
    "draft_cpu_mask_batch": ("0x3", "0x3"),
    "draft_cpu_strict_batch": ("1", 1),
    "draft_prio_batch": ("3", 3),
    "draft_poll_batch": ("1", 1),
    "draft_cache_type_k": ("q8_0", "q8_0"),
    "draft_cache_type_v": ("q4_0", "q4_0"),
    "draft_override_tensor": ("blk\\.0\\..*=CPU", ("blk\\.0\\..*=CPU",)),
    "draft_n_cpu_moe": ("4", 4),
    "draft_n_max": ("5", 5),
    "draft_n_min": ("2", 2),
    "synth_len": ("2.5", 2.5),
    "synth_rates": ("0.9, 0.5", (0.9, 0.5)),  # each part stripped (string_strip), then std::stod
    "draft_p_split": ("0.25", 0.25),
    "draft_p_min": ("0.75", 0.75),
    "draft_devices": ("none", "none"),
    "draft_n_gpu_layers": ("all", -2),  # llama-server: 'auto' -1, 'all' -2
    "draft_model": (DRAFT_PRESET, None),  # the resolved file (see expected())
    "types": ("ngram-mod,suffix", ("none", "ngram-mod", "suffix")),  # added to llama-server's ("none",)
    "ngram_mod_n_min": ("16", 16),
    "ngram_mod_n_max": ("32", 32),
    "ngram_mod_n_match": ("8", 8),
    **{
        f"{kind}_{what}": (text, int(text))
        for kind in ("ngram_simple", "ngram_map_k", "ngram_map_k4v")
        for what, text in (("size_n", "6"), ("size_m", "20"), ("min_hits", "2"))
    },
    "suffix_n_max": ("16", 16),
    "suffix_max_depth": ("32", 32),
    "suffix_min_match": ("4", 4),
    "suffix_max_spec_factor": ("2", 2.0),
    "suffix_max_spec_offset": ("-1", -1.0),
    "suffix_min_token_prob": ("0.5", 0.5),
    "suffix_cache_tokens": ("1000", 1000),
    "budget_row_cost": ("0.5", 0.5),
}
VALUED = [
    (name, opt)
    for opt in SPEC_OPTIONS
    if opt.field and opt.value and opt.field != "draft_hf_repo"
    for name in opt.names
]
SWITCHES = [opt for opt in SPEC_OPTIONS if opt.field and opt.value is None]


def parse(*argv: str, env: dict | None = None):
    return cli.parse_args(list(argv), environ=env or {})


def speculative(*argv: str, env: dict | None = None) -> SpecSettings:
    args = parse(*argv, env=env)
    return engine_config(args, llama_options(args)).speculative


def refused(capsys, *argv: str, env: dict | None = None) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(*argv, env=env)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: hydra-trio run ")
    return err


def expected(field: str) -> object:
    text, value = SAMPLE[field]
    return str(resolve_model(text)[0]) if field == "draft_model" else value


# --------------------------------------------------------------------------- the table


def test_every_option_is_a_flag_of_its_class_and_group() -> None:
    for opt in SPEC_OPTIONS:
        for name in opt.names + opt.neg:
            f = BY_NAME[name]
            assert (f.names, f.neg, f.env, f.value) == (opt.names, opt.neg, opt.env, opt.value), name
            if opt.own:
                assert (f.kind, f.group) == (OWN, "hydra"), name
            elif opt.field == "draft_hf_repo":
                assert f.kind == REFUSED, name
            else:
                assert (f.kind, f.group) == (WIRED, "speculative"), name
    missing = sorted(
        opt.field
        for opt in SPEC_OPTIONS
        if opt.field and opt.field != "draft_hf_repo" and opt.value and opt.field not in SAMPLE
    )
    assert not missing, f"options with no sample value here: {missing}"


def test_no_option_given_leaves_llama_servers_defaults() -> None:
    spec = speculative()
    assert spec == SpecSettings() and spec.types == ("none",) and spec.enabled == ()
    assert (spec.draft_n_max, spec.draft_n_min, spec.draft_p_min, spec.ngram_mod_n_match) == (3, 0, 0.0, 24)


# --------------------------------------------------------------------------- each flag lands


@pytest.mark.parametrize(("name", "opt"), VALUED, ids=[n for n, _ in VALUED])
def test_each_flag_lands_in_the_engine_config(name: str, opt) -> None:
    spec = speculative(name, SAMPLE[opt.field][0])
    assert getattr(spec, opt.field) == expected(opt.field) != opt.default
    assert attrs_except(spec, opt.field) == attrs_except(SpecSettings(), opt.field)


def attrs_except(spec: SpecSettings, field: str) -> dict:
    import attrs

    return {k: v for k, v in attrs.asdict(spec, recurse=False).items() if k != field}


@pytest.mark.parametrize("opt", SWITCHES, ids=[o.names[0] for o in SWITCHES])
def test_each_switch_and_its_negative_lands(opt) -> None:
    for name in opt.names:
        first = opt.neg[:1]  # a switch on by default is turned off first, so that turning it on shows
        assert getattr(speculative(*first, name), opt.field) is True
    for name in opt.neg:
        assert getattr(speculative(name), opt.field) is False


def test_spec_default_is_llama_servers_ngram_mod_preset_applied_in_command_line_order() -> None:
    spec = speculative("--spec-default")
    assert spec.enabled == ("ngram-mod",)
    assert (spec.ngram_mod_n_match, spec.ngram_mod_n_min, spec.ngram_mod_n_max) == (24, 48, 64)
    assert speculative("--spec-default", "--spec-ngram-mod-n-max", "32").ngram_mod_n_max == 32
    assert speculative("--spec-ngram-mod-n-max", "32", "--spec-default").ngram_mod_n_max == 64


def test_spec_type_adds_to_the_list_each_time_and_none_ends_a_list() -> None:
    assert speculative("--spec-type", "ngram-mod", "--spec-type", "suffix,ngram-simple").types == (
        "none",
        "ngram-mod",
        "suffix",
        "ngram-simple",
    )
    # common_speculative_types_from_names stops at none: what follows it is not even checked
    assert speculative("--spec-type", "none,draft-eagle3,nonsense").types == ("none", "none")
    assert speculative("--spec_type", "ngram-cache").enabled == ("ngram-cache",)  # --long_name as llama-server
    assert speculative("--spec-draft-n-max", "5", "--spec-draft-n-max", "2").draft_n_max == 2  # the last one


def test_override_tensors_for_the_draft_add_up() -> None:
    assert speculative("-otd", "a=CPU,b=CPU", "--override-tensor-draft", "c=CPU").draft_override_tensor == (
        "a=CPU,b=CPU",
        "c=CPU",
    )


def test_draft_threads_of_0_or_less_are_every_core() -> None:
    import os

    assert speculative("-td", "0", "-tbd", "-4").draft_threads == os.cpu_count()  # hardware_concurrency()


# --------------------------------------------------------------------------- the environment


ENV = [(opt.env, opt) for opt in SPEC_OPTIONS if opt.env and opt.field and opt.value and opt.field != "draft_hf_repo"]


@pytest.mark.parametrize(("env", "opt"), ENV, ids=[e for e, _ in ENV])
def test_each_environment_variable_sets_its_option(env: str, opt) -> None:
    spec = speculative(env={env: SAMPLE[opt.field][0]})
    assert getattr(spec, opt.field) == expected(opt.field) != opt.default


def test_environment_switches_and_a_flag_wins_over_a_variable() -> None:
    assert speculative(env={"LLAMA_ARG_NO_SPEC_DRAFT_BACKEND_SAMPLING": "1"}).draft_backend_sampling is False
    assert speculative(env={"LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING": "off"}).draft_backend_sampling is False
    assert speculative(env={"LLAMA_ARG_SPEC_DRAFT_CPU_MOE": "1"}).draft_cpu_moe is True
    env = {"LLAMA_ARG_SPEC_DRAFT_N_MAX": "7", "LLAMA_ARG_SPEC_TYPE": "ngram-mod", "LLAMA_ARG_SPEC_DRAFT_P_MIN": "0.5"}
    spec = speculative("--spec-draft-n-max", "3", "--spec-type", "suffix", env=env)
    assert (spec.draft_n_max, spec.draft_p_min) == (3, 0.5)
    assert spec.types == ("none", "ngram-mod", "suffix")  # llama-server: the variable's types, then the flag's


# --------------------------------------------------------------------------- wrong values, llama-server's words


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--spec-draft-n-max", "-1"], "argument --spec-draft-n-max: invalid value"),
        (["--spec-draft-n-max", "three"], "argument --spec-draft-n-max: stoi"),
        (["--spec-draft-n-cpu-moe", "-1"], "invalid value"),
        (["--spec-ngram-mod-n-min", "1025"], "ngram n-min must be between 0 and 1024 inclusive"),
        (["--spec-ngram-mod-n-max", "-1"], "ngram n-max must be between 0 and 1024 inclusive"),
        (["--spec-ngram-mod-n-match", "0"], "ngram size N must be between 1 and 1024 inclusive"),
        (["--spec-ngram-simple-size-n", "2000"], "ngram size N must be between 1 and 1024 inclusive"),
        (["--spec-ngram-map-k-size-m", "0"], "ngram size M must be between 1 and 1024 inclusive"),
        (["--spec-ngram-map-k4v-min-hits", "0"], "ngram min hits must be at least 1"),
        (["--spec-type", "ngram-mod,,suffix"], "argument --spec-type: unknown speculative type: \n"),
        (["--spec-type", "NGRAM-MOD"], "unknown speculative type: NGRAM-MOD"),
        (["-ctkd", "q9_0"], "argument --spec-draft-type-k/-ctkd/--cache-type-k-draft: Unsupported cache type: q9_0"),
        (["-ctvd", "F16"], "Unsupported cache type: F16"),
        (["--spec-draft-prio", "4"], "argument --spec-draft-prio/--prio-draft: invalid value"),
        (["--spec-synth-len", "-1"], "argument --spec-synth-len: invalid value"),
        (["--spec-synth-len", "1.5x"], "argument --spec-synth-len: invalid value"),
        (["--spec-synth-rates", "0.5,x"], "argument --spec-synth-rates: invalid value"),
        (["--spec-draft-p-min", "abc"], "argument --spec-draft-p-min/--draft-p-min: stof"),
        (["-Cd", "zz"], "argument --spec-draft-cpu-mask/-Cd/--cpu-mask-draft: invalid cpumask"),
        (["-Crd", "x"], "argument --spec-draft-cpu-range/-Crd/--cpu-range-draft: invalid range"),
        (["-devd", "CPU,"], "argument --spec-draft-device/-devd/--device-draft: invalid device: \n"),
        (["-otd", "token_embd"], "argument --spec-draft-override-tensor/-otd/--override-tensor-draft: invalid value"),
        (["-ngld", "many"], "stoi"),
        (["-td", "x"], "argument --spec-draft-threads/-td/--threads-draft: stoi"),
        (["--spec-suffix-min-match", "0"], "suffix min match must be between 1 and 64 inclusive"),
    ],
)
def test_wrong_values_exit_2_with_llama_servers_message(capsys, argv: list[str], message: str) -> None:
    assert message in refused(capsys, *argv)


def test_a_wrong_environment_value_names_the_variable(capsys) -> None:
    err = refused(capsys, env={"LLAMA_ARG_SPEC_DRAFT_N_MAX": "x"})
    assert "environment variable LLAMA_ARG_SPEC_DRAFT_N_MAX (--spec-draft-n-max): stoi" in err
    err = refused(capsys, env={"LLAMA_ARG_SPEC_TYPE": "ngram"})
    assert "environment variable LLAMA_ARG_SPEC_TYPE (--spec-type): unknown speculative type: ngram" in err


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--draft", "4"], None, "the argument has been removed. use --spec-draft-n-max or --spec-ngram-mod-n-max"),
        (["--draft-max", "x"], None, "argument --draft/--draft-n/--draft-max: stoi"),  # its int is read first
        (
            ["--draft-n-min", "1"],
            None,
            "the argument has been removed. use --spec-draft-n-min or --spec-ngram-mod-n-min",
        ),
        (["--spec-ngram-size-n", "3"], None, "the argument has been removed. use the respective --spec-ngram-*-size-n"),
        (["--spec-ngram-size-m", "3"], None, "the argument has been removed. use the respective --spec-ngram-*-size-m"),
        (
            ["--spec-ngram-min-hits", "3"],
            None,
            "the argument has been removed. use the respective --spec-ngram-*-min-hits",
        ),
        (
            [],
            {"LLAMA_ARG_DRAFT_MAX": "4"},
            (
                "environment variable LLAMA_ARG_DRAFT_MAX (--draft): the argument has "
                "been removed. use --spec-draft-n-max"
            ),
        ),
        ([], {"LLAMA_ARG_DRAFT_MIN": "4"}, "the argument has been removed. use --spec-draft-n-min"),
    ],
)
def test_removed_options_exit_2_as_llama_server(capsys, argv: list[str], env: dict | None, message: str) -> None:
    assert message in refused(capsys, *argv, env=env)


# --------------------------------------------------------------------------- refusals that name why


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_types_the_bindings_cannot_serve_are_refused_naming_why(capsys, name: str) -> None:
    err = refused(capsys, "--spec-type", f"ngram-mod,{name}")
    assert f"argument --spec-type: {UNSUPPORTED[name]}" in err
    assert "llama_set_embeddings_layer_inp" in err  # the missing binding is named
    err = refused(capsys, env={"LLAMA_ARG_SPEC_TYPE": name})
    assert f"environment variable LLAMA_ARG_SPEC_TYPE (--spec-type): {UNSUPPORTED[name]}" in err


def test_draft_simple_takes_its_draft_model_and_parses_without_one() -> None:
    # llama-server starts without -md too: common_speculative_impl_draft_simple then throws "draft-simple
    # requires a draft context", the server logs that and serves without speculative decoding
    assert speculative("--spec-type", "draft-simple").enabled == ("draft-simple",)
    spec = speculative("-m", "smollm2-135m", "-md", "smollm2-135m-q8", "--spec-type", "draft-simple")
    assert spec.enabled == ("draft-simple",) and spec.draft_model == str(resolve_model("smollm2-135m-q8")[0])
    assert Path(spec.draft_model).is_file()
    spec = speculative("--spec-type", "draft-simple", env={"LLAMA_ARG_SPEC_DRAFT_MODEL": DRAFT_PRESET})
    assert spec.draft_model == str(resolve_model(DRAFT_PRESET)[0])


def test_draft_mtp_is_taken_at_parse_time() -> None:
    spec = speculative("--spec-type", "draft-mtp", "--spec-draft-n-max", "3")  # MTP layers are known at load
    assert (spec.enabled, spec.draft_n_max, spec.draft_model) == (("draft-mtp",), 3, "")


@pytest.mark.parametrize("name", ["--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft"])
def test_a_draft_from_hugging_face_is_refused_nothing_is_downloaded(capsys, name: str) -> None:
    err = refused(capsys, name, "ggml-org/tiny:Q8_0")
    assert f"error: {name}: not supported by hydra-trio: " in err and "downloads nothing" in err
    err = refused(capsys, env={"LLAMA_ARG_SPEC_DRAFT_HF_REPO": "ggml-org/tiny"})
    assert "environment variable LLAMA_ARG_SPEC_DRAFT_HF_REPO (--spec-draft-hf): not supported by hydra-trio" in err


def test_a_draft_model_that_is_neither_a_file_nor_a_preset_is_refused(tmp_path: Path) -> None:
    args = parse("-md", str(tmp_path / "missing.gguf"), "--spec-type", "draft-simple")
    with pytest.raises(PresetError, match=r"--spec-draft-model/-md/--model-draft: model .* is neither a file nor"):
        engine_config(args, llama_options(args))
    # the whole path: exit 2 before anything binds or loads
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hydra_trio",
            "--port",
            str(free_port()),
            "--no-rpc-backend",
            "-md",
            "no-such-draft",
            "--spec-type",
            "draft-simple",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 2, out
    assert (
        "--spec-draft-model/-md/--model-draft: model 'no-such-draft' is neither a file nor a known alias" in out.stderr
        and "listening" not in out.stderr
    )


# --------------------------------------------------------------------------- the cluster's head


def test_the_launchers_argv_of_the_clusters_head_parses_with_draft_mtp(tmp_path: Path) -> None:
    args = parse(*launcher_argv(tmp_path, 8080, 9503), "--spec-type", "draft-mtp", "--spec-draft-n-max", "3")
    assert (args.port, args.parallel, args.ctx_size, args.cache_type_k) == (8080, 2, 4096, "q8_0")
    spec = engine_config(args, llama_options(args)).speculative
    assert (spec.enabled, spec.draft_n_max, spec.n_max()) == (("draft-mtp",), 3, 3)
