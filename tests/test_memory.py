"""A node's resident memory: what it does not import, the heap it gives back, and the two
stand-ins that make it so (``hydra_trio.engine.llama.bindings``, ``hydra_trio.engine.llama.jinja_chat``)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, wait_for

HEAVY = (
    "numpy",
    "llama_cpp.llama",
    "llama_cpp.llama_chat_format",
    "gguf",
    "yaml",
    "diskcache",
    "rich",
    "trio_websocket",
    "pythonjsonlogger",
    "hypothesis",
    "importlib.metadata",
)
"""Modules a serving node has no use for until a request asks (numpy: log-probabilities) or never."""


def _python(code: str) -> str:
    """Run ``code`` in a fresh interpreter from the repository root; its stdout."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_node_modules_import_none_of_the_heavy_ones() -> None:
    loaded = json.loads(
        _python(
            "import json, sys\n"
            "import hydra_trio.cli, hydra_trio.cli.run, hydra_trio.node.server, hydra_trio.openai.embeddings\n"
            "import hydra_trio.engine.engine, hydra_trio.engine.llama.model\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules] + [len(sys.modules)]))"
        )
    )
    *heavy, n = loaded
    assert heavy == []
    assert n > 300  # the scan looked at a whole node's modules (602 when written)


def test_llama_cpp_is_whole_when_asked() -> None:
    """After ``import hydra_trio``, ``import llama_cpp`` has the bindings without numpy, and a name of the
    high-level half (``Llama``) loads it: code that wants the whole package still gets it."""
    out = json.loads(
        _python(
            "import json, sys, importlib.metadata\n"
            "import hydra_trio, llama_cpp\n"
            "steps = [llama_cpp.__version__ == importlib.metadata.version('llama-cpp-python'),"
            " 'numpy' in sys.modules]\n"
            "steps += [callable(llama_cpp.llama_backend_init), 'numpy' in sys.modules]\n"
            "from llama_cpp import Llama\n"
            "steps += [Llama.__module__, 'numpy' in sys.modules, llama_cpp.LlamaGrammar.__name__]\n"
            "try:\n"
            "    llama_cpp.no_such_name\n"
            "except AttributeError as exc:\n"
            "    steps.append(str(exc))\n"
            "print(json.dumps(steps))"
        )
    )
    assert out == [
        True,
        False,
        True,
        False,
        "llama_cpp.llama",
        True,
        "LlamaGrammar",
        "module 'llama_cpp' has no attribute 'no_such_name'",
    ]


TEMPLATES = {
    "loop controls, generation tag, tojson": (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "<{{ m.role }}>{% generation %}{{ m.content }}{% endgeneration %}</{{ m.role }}>"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
        "{% if tools %}{{ tools | tojson }}|{{ tools | tojson(indent=2) }}{% endif %}"
        "{% if enable_thinking is defined %}[think={{ enable_thinking }}]{% endif %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}"
    ),
    "whitespace control": "{%- for m in messages %}\n  {{ m.content }}\n{% endfor -%}\n{{ strftime_now('%Y') }}",
    "raise_exception": "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools: ' + "
    "m.role) }}{% endif %}{{ m.content }}{% endfor %}",
}
MESSAGES = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": 'é ü 日本 "quoted" <tag>'},
        {"role": "assistant", "content": "ok"},
        {"role": "skip", "content": "x"},
        {"role": "user", "content": "more"},
    ],
    [{"role": "user", "content": str(i)} for i in range(9)],
    [{"role": "tool", "content": "result"}],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "météo",
            "parameters": {"type": "object", "properties": {"city": {}}},
        },
    }
]


def _gguf_chat_template() -> str:
    """The packaged default model's ``tokenizer.chat_template``, read with a vocabulary-only load."""
    import llama_cpp

    from hydra_trio.models.presets import resolve_model

    path, _ = resolve_model("smollm2-135m")
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model
    try:
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(model, b"tokenizer.chat_template", buf, len(buf))
        assert 0 < n < len(buf)
        return buf.value.decode()
    finally:
        llama_cpp.llama_model_free(model)


def _render(fmt: object, messages: list, tools: list | None, kwargs: dict) -> str:
    try:
        out = fmt(messages=messages, tools=tools, **kwargs)  # type: ignore[operator]
    except ValueError as exc:
        return f"ValueError: {exc}"
    return out if isinstance(out, str) else out.prompt


@pytest.mark.parametrize("name", [*TEMPLATES, "the default model's GGUF template"])
def test_the_jinja_renderer_renders_as_llama_cpp_python(name: str) -> None:
    """:class:`~hydra_trio.engine.llama.jinja_chat.JinjaChatFormatter` against the ``Jinja2ChatFormatter`` whose
    behaviour it follows,
    on the same templates, messages, tools and extra variables: the same prompt, or the same error."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from hydra_trio.engine.llama.jinja_chat import JinjaChatFormatter

    text = TEMPLATES.get(name) or _gguf_chat_template()
    theirs = Jinja2ChatFormatter(template=text, eos_token="</s>", bos_token="<s>", add_generation_prompt=True)
    ours = JinjaChatFormatter(template=text, eos_token="</s>", bos_token="<s>", add_generation_prompt=True)
    rendered = 0
    for messages in MESSAGES:
        for tools in (None, TOOLS):
            for kwargs in ({}, {"enable_thinking": False}):
                expected = _render(theirs, messages, tools, kwargs)
                assert _render(ours, messages, tools, kwargs) == expected, (messages, tools, kwargs)
                rendered += not expected.startswith("ValueError")
    assert rendered >= 8  # most cases render (only the raise_exception template refuses a tool message)


def test_a_template_that_does_not_compile_is_refused_as_before() -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from hydra_trio.engine.llama.jinja_chat import JinjaChatFormatter

    errors = []
    for cls in (Jinja2ChatFormatter, JinjaChatFormatter):
        with pytest.raises(Exception) as info:
            cls(template="{% for m in messages %}", eos_token="", bos_token="")
        errors.append((type(info.value).__name__, str(info.value)))
    assert errors[0] == errors[1] and errors[0][0] == "TemplateSyntaxError"


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs procfs")
def test_a_serving_node_maps_no_numpy_until_log_probabilities_and_trims_its_heap(spawn) -> None:
    """A real node: serving chat maps none of numpy's libraries; the heap is trimmed after the load and
    when the last request finishes (DEBUG lines with the resident size); the first request for
    log-probabilities imports numpy then and gets them.  (No ggml-RPC backend: at DEBUG it logs where
    gguf's type sizes differ from ggml's, and gguf imports numpy.)"""
    with spawn("--log-level", "DEBUG", "--no-rpc-backend").serving() as srv:
        pid = srv.proc.pid
        line = wait_for(
            lambda: next((x for x in srv.log().splitlines() if "heap trimmed after loading" in x), None),
            what="the trim after the load",
        )
        resident = float(line.split("resident ")[1].split(" MiB")[0])
        assert 100 < resident < 2000  # a real figure in MiB, not bytes or pages
        body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{srv.base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        wait_for(lambda: "heap trimmed idle" in srv.log(), what="the trim once every slot is idle")
        assert "numpy" not in _maps(pid)
        r = httpx.post(
            f"{srv.base}/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 2}, timeout=120
        )
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert content and len(content[0]["top_logprobs"]) == 2 and content[0]["logprob"] <= 0
        assert "numpy" in _maps(pid)  # the check above can see numpy when it is there
