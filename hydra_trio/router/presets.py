"""Router-mode models as llama-server builds them (``common/preset.cpp`` and ``tools/server/server-models.cpp``
of the llama.cpp that llama-cpp-python 0.3.36 vendors): each model is a set of flags with values, from an INI
section (``--models-preset``) or a GGUF file (``--models-dir``), cascaded over the ``[*]`` section and under
the router's own command line, rendered into the argv of its child node.

A preset key is a flag's spelling without its dashes (``ctx-size``, ``c``, ``no-warmup``) or its
environment variable (``LLAMA_ARG_CTX_SIZE``; ``LLAMA_ARG_NO_*`` turns a switch off); ``version`` is
skipped; ``load-on-startup`` and ``stop-timeout`` are preset-only keys.  A negative spelling stores the
switch's value inverted (``no-warmup = true`` is ``warmup = false``).  Precedence, highest first: the
router's command line, the model's section, ``[*]``.

The flags themselves (:class:`OptionSpec`) come from the command line's table (:mod:`hydra_trio.cli`), which
also checks each model's argv: this module knows their spellings, not their meaning.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

from .ini import DEFAULT_SECTION, canonical_name, parse_ini

TRUTHY = ("on", "enabled", "true", "1")
FALSEY = ("off", "disabled", "false", "0")
"""A switch's values, as llama-server's ``common_arg_utils::is_truthy`` / ``is_falsey``."""

LOAD_ON_STARTUP = "load-on-startup"
STOP_TIMEOUT = "stop-timeout"
DEFAULT_STOP_TIMEOUT = 10
"""Seconds between the stop asked of a child and its kill, unless ``stop-timeout`` says (llama-server's)."""

RESERVED = (
    "--ssl-key-file",
    "--ssl-cert-file",
    "--api-key",
    "--api-key-file",
    "--models-dir",
    "--models-max",
    "--models-preset",
    "--models-autoload",
)
"""Flags (by their last spelling) dropped from every model: the router's own (llama-server's
``unset_reserved_args``)."""

ROUTER_ONLY = (
    "--model",
    "--mmproj",
    "--alias",
    "--hf-repo",
    "--log-file",
    "--tls-cert",
    "--tls-key",
    "--tls-client-ca",
    "--tls-required",
    "--rpc-port",
    "--ggml-rpc-port",
    "--no-model",
    "--control-allow",
    "--hydra-token",
    "--hydra-token-file",
    "--rpc-allow",
    "--allow-subject",
    "--no-router-spare",
)
"""Flags of the router's command line that do not pass to its models: llama-server's model flags and log
file, the node's own TLS and extra ports (a child listens on loopback, on its own port), and the access
rules of the router's port (the router applies them to its Hydra and ggml-RPC clients; a child serves only
the router)."""

SET_BY_ROUTER = ("--host", "--port", "--alias")
"""Flags the router sets for each child (loopback, a free port, the model's name as its alias)."""


@attrs.frozen
class OptionSpec:
    """One flag as presets spell it.

    Attributes:
        names: its spellings in llama-server's order: the first sorts the rendered argv (llama-server keeps
            options ordered by it), the last is the one rendered.
        neg: the negative spellings of a switch.
        takes_value: False for a switch.
        env: its ``LLAMA_ARG_*`` variable.
        preset_only: a preset key that is no flag (``load-on-startup``, ``stop-timeout``).
    """

    names: tuple[str, ...]
    neg: tuple[str, ...] = ()
    takes_value: bool = True
    env: str | None = None
    preset_only: bool = False

    @property
    def name(self) -> str:
        """The rendered spelling (``--ctx-size``)."""
        return self.names[-1]

    @property
    def ini_key(self) -> str:
        """The key the preset text (``/models``'s ``preset``) writes: :attr:`name` without its dashes."""
        return self.name.lstrip("-")


PRESET_ONLY = (OptionSpec((LOAD_ON_STARTUP,), preset_only=True), OptionSpec((STOP_TIMEOUT,), preset_only=True))


@attrs.frozen
class Option:
    """A value given to a flag, with where it was written (``key`` as written, ``origin`` the section or
    ``the command line``) for the messages that refuse it."""

    spec: OptionSpec
    value: str
    key: str
    origin: str


class ModelsConfigError(ValueError):
    """A preset the router refuses; the message names the preset, the key and the reason."""


class OptionTable:
    """Preset keys to flags: every spelling without its dashes, the environment variables."""

    def __init__(self, specs: Iterable[OptionSpec]) -> None:
        self.keys: dict[str, tuple[OptionSpec, bool]] = {}
        self.by_name: dict[str, OptionSpec] = {}
        for spec in [*specs, *PRESET_ONLY]:
            for n in spec.names:
                self.keys[n.lstrip("-")] = (spec, False)
                self.by_name[n] = spec
            for n in spec.neg:
                self.keys[n.lstrip("-")] = (spec, True)
                self.by_name[n] = spec
            if spec.env:
                self.keys[spec.env] = (spec, False)
                if spec.neg:
                    self.keys[spec.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)] = (spec, True)

    def option(self, key: str, value: str, origin: str) -> Option:
        """The option of ``key = value`` in section ``origin``.

        Raises:
            ModelsConfigError: an unknown key, or a switch's value that is no boolean.
        """
        found = self.keys.get(key)
        if found is None:
            raise ModelsConfigError(f"option '{key}' not recognized in preset '{origin}'")
        spec, negative = found
        if not spec.takes_value:
            if value not in TRUTHY + FALSEY:
                raise ModelsConfigError(
                    f"preset '{origin}': key '{key}': '{value}' is no boolean (one of {', '.join(TRUTHY + FALSEY)})"
                )
            if negative:
                value = "false" if value in TRUTHY else "true"
        return Option(spec, value, key, origin)

    def from_argv(self, argv: list[str]) -> dict[str, Option]:
        """The options of a command line (the router's), last one winning as in llama-server's
        ``common_params_to_map``; a switch is ``1`` or ``0``.  Tokens that are no flag are left out (the
        command line was parsed before)."""
        out: dict[str, Option] = {}
        i = 0
        while i < len(argv):
            token = argv[i]
            name, eq, inline = token.partition("=") if token.startswith("--") else (token, "", "")
            spec = self.by_name.get(name)
            i += 1
            if spec is None:
                continue
            if not spec.takes_value:
                out[spec.names[0]] = Option(spec, "0" if name in spec.neg else "1", name, "the command line")
                continue
            if eq:
                value = inline
            elif i < len(argv):
                value = argv[i]
                i += 1
            else:
                continue
            out[spec.names[0]] = Option(spec, value, name, "the command line")
        return out


@attrs.frozen
class ModelPreset:
    """One model of the router: its name, where it comes from (``preset`` or ``models_dir``, llama-server's
    ``source``) and its options, keyed by their flag's first spelling."""

    name: str
    source: str
    options: Mapping[str, Option]

    def get(self, name: str) -> str | None:
        """The value given to the flag spelled ``name`` (any spelling), else None."""
        for option in self.options.values():
            if name in option.spec.names or name in option.spec.neg:
                return option.value
        return None

    def without(self, names: Iterable[str]) -> ModelPreset:
        names = set(names)
        return attrs.evolve(self, options={k: o for k, o in self.options.items() if o.spec.name not in names})

    def over(self, base: Mapping[str, Option]) -> ModelPreset:
        """This preset's options over ``base``'s (llama-server's ``cascade``: this one wins)."""
        return attrs.evolve(self, options={**base, **self.options})

    def under(self, top: Mapping[str, Option]) -> ModelPreset:
        """``top``'s options over this preset's (the router's command line over every model)."""
        return attrs.evolve(self, options={**self.options, **top})

    def argv(self) -> list[str]:
        """The flags of the child node, ordered as llama-server orders them (by their first spelling);
        preset-only keys are left out; a switch turned off is its negative spelling, or left out when it has
        none."""
        out: list[str] = []
        for key in sorted(self.options, key=lambda k: k.encode()):
            option = self.options[key]
            spec = option.spec
            if spec.preset_only:
                continue
            if spec.takes_value:
                out += [spec.name, option.value]
            elif option.value in FALSEY:
                if spec.neg:
                    out.append(spec.neg[-1])
            else:
                out.append(spec.name)
        return out

    def ini(self) -> str:
        """The preset as llama-server's ``/models`` shows it (``common_preset::to_ini``): ``[name]``, then
        ``key = value`` by the flag's last spelling, in :meth:`argv`'s order, and an empty line."""
        lines = [f"[{self.name}]"]
        for key in sorted(self.options, key=lambda k: k.encode()):
            option = self.options[key]
            lines.append(f"{option.spec.ini_key} = {option.value.replace(chr(10), chr(92) + chr(10))}")
        return "\n".join(lines) + "\n\n"


def read_preset_file(path: Path, table: OptionTable) -> tuple[dict[str, Option], list[ModelPreset]]:
    """The ``[*]`` options and the models of a ``--models-preset`` file, in file order.

    Raises:
        ModelsConfigError: the file cannot be read or parsed, or one of its keys is refused
            (:meth:`OptionTable.option`).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelsConfigError(f"failed to open server preset file: {path}: {exc}") from exc
    try:
        sections = parse_ini(text, str(path))
    except ValueError as exc:
        raise ModelsConfigError(str(exc)) from exc
    global_options: dict[str, Option] = {}
    models: dict[str, ModelPreset] = {}
    for section, items in sections.items():
        name = canonical_name(section)
        options: dict[str, Option] = {}
        for key, value in items.items():
            if key == "version":
                continue
            option = table.option(key, value, name)
            options[option.spec.names[0]] = option
        if name == DEFAULT_SECTION and not options:
            continue
        if name == "*":
            global_options = options
        else:
            models[name] = ModelPreset(name, "preset", options)
    return global_options, list(models.values())


def scan_models_dir(directory: Path, table: OptionTable) -> list[ModelPreset]:
    """The models of a ``--models-dir``, as llama-server's ``load_from_models_dir``: each ``*.gguf`` is a model
    named after its file (without ``.gguf``), except projectors (``mmproj`` in the name) and drafts
    (``mtp-``, ``dspark-``, ``dflash-``); each folder holding a GGUF is a model named after the folder, with
    its ``mmproj*.gguf`` as ``--mmproj``, its first draft file as ``--spec-draft-model`` and the first shard
    (``-00001-of-``) of a split model.

    Raises:
        ModelsConfigError: ``directory`` is no directory.
    """
    if not directory.is_dir():
        raise ModelsConfigError(f"error: '{directory}' does not exist or is not a directory")
    drafts = ("mtp-", "dspark-", "dflash-")
    models: list[ModelPreset] = []

    def add(name: str, model: Path, mmproj: Path | None = None, draft: Path | None = None) -> None:
        opts = [("model", str(model))]
        if mmproj is not None:
            opts.append(("mmproj", str(mmproj)))
        if draft is not None and "spec-draft-model" in table.keys:
            opts.append(("spec-draft-model", str(draft)))
        options = {(o := table.option(k, v, name)).spec.names[0]: o for k, v in opts}
        models.append(ModelPreset(name, "models_dir", options))

    for entry in sorted(directory.iterdir(), key=lambda p: p.name):
        if entry.is_dir():
            files = sorted(p for p in entry.iterdir() if p.name.endswith(".gguf"))
            mmproj = next((p for p in files if "mmproj" in p.name), None)
            draft = next((p for p in files if p.name.startswith(drafts) and "mmproj" not in p.name), None)
            rest = [p for p in files if p not in (mmproj, draft) and not p.name.startswith(drafts)]
            shard = next((p for p in rest if "-00001-of-" in p.name), None)
            main = shard or next((p for p in rest if "-of-" not in p.name), None)
            if main is not None:
                add(entry.name, main, mmproj, draft)
        elif entry.name.endswith(".gguf") and "mmproj" not in entry.name and not entry.name.startswith(drafts):
            add(entry.name.replace(".gguf", ""), entry)
    return models


def child_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: the router's (children inherit it, as llama-server's), without the router-mode
    variables (``LLAMA_ARG_MODELS_*``)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith("LLAMA_ARG_MODELS_")}
