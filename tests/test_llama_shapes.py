"""llama-server's status replies, key for key and type for type: ``/slots`` (and ``?fail_on_no_slot``),
``/props``, ``/v1/models``, ``/health`` and the ``llamacpp:`` families of ``/metrics``, against a real node on
the real SmolLM2.

The reference shapes below are written down from the llama.cpp that llama-cpp-python 0.3.36 vendors:
``tools/server/server-context.cpp`` (``server_slot::to_json``, ``get_res_props``, ``get_res_models``,
``get_res_model_info``, the ``/health`` and ``/slots`` handlers and the loading middleware of
``tools/server/server-http.cpp``) and ``tools/server/server-task.cpp`` (``task_params::to_json`` with
``only_metrics`` true, what ``/slots`` and ``/props`` send unless ``LLAMA_SERVER_SLOTS_DEBUG`` is set;
``server_task_result_metrics::to_metrics``).  A reply must hold every key of its reference with the same JSON
type (a float written with a decimal point is a float, an integer an integer, nested objects and the
elements of arrays alike); it may hold more (the node's own ``n_past``, ``kv_cache``, ``status``, ...).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import ServerProcess, streaming

# --------------------------------------------------------------------------- llama-server's shapes

PARAMS = {  # task_params::to_json(only_metrics = true), tools/server/server-task.cpp
    "seed": int,
    "temperature": float,
    "dynatemp_range": float,
    "dynatemp_exponent": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "top_n_sigma": float,
    "xtc_probability": float,
    "xtc_threshold": float,
    "typical_p": float,
    "repeat_last_n": int,
    "repeat_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "dry_multiplier": float,
    "dry_base": float,
    "dry_allowed_length": int,
    "dry_penalty_last_n": int,
    "mirostat": int,
    "mirostat_tau": float,
    "mirostat_eta": float,
    "adaptive_target": float,
    "adaptive_decay": float,
    "max_tokens": int,
    "n_predict": int,
    "n_keep": int,
    "n_discard": int,
    "ignore_eos": bool,
    "stream": bool,
    "n_probs": int,
    "min_keep": int,
    "chat_format": str,
    "reasoning_format": str,
    "reasoning_in_content": bool,
    "generation_prompt": str,
    "samplers": [str],
    "speculative.types": str,
    "timings_per_token": bool,
    "post_sampling_probs": bool,
    "backend_sampling": bool,
    "lora": [{"id": int, "scale": float}],
}

SLOT = {"id": int, "n_ctx": int, "speculative": bool, "is_processing": bool}
"""server_slot::to_json for a slot that never had a task."""

SLOT_WITH_TASK = {
    **SLOT,
    "id_task": int,
    "n_prompt_tokens": int,
    "n_prompt_tokens_processed": int,
    "n_prompt_tokens_cache": int,
    "params": PARAMS,
    "next_token": [{"has_next_token": bool, "has_new_line": bool, "n_remain": int, "n_decoded": int}],
}
"""server_slot::to_json once the slot ran a task (``next_token``: an array of one object)."""

CAPS = {
    name: bool
    for name in (  # common/jinja/caps.cpp, caps::to_map
        "supports_string_content",
        "supports_typed_content",
        "supports_tools",
        "supports_tool_calls",
        "supports_parallel_tool_calls",
        "supports_system_role",
        "supports_preserve_reasoning",
        "supports_reasoning_effort",
        "supports_object_arguments",
    )
}

PROPS = {  # get_res_props
    "default_generation_settings": {"params": PARAMS, "n_ctx": int},
    "total_slots": int,
    "model_alias": str,
    "model_ftype": str,
    "model_path": str,
    "modalities": {"vision": bool, "video": bool, "audio": bool},
    "media_marker": str,
    "endpoint_slots": bool,
    "endpoint_props": bool,
    "endpoint_metrics": bool,
    "ui": bool,
    "ui_settings": dict,
    "chat_template": str,
    "chat_template_caps": CAPS,
    "bos_token": str,
    "eos_token": str,
    "build_info": str,
    "is_sleeping": bool,
    "cors_proxy_enabled": bool,
}

MODELS = {  # get_res_models, get_res_model_info
    "models": [
        {
            "name": str,
            "model": str,
            "modified_at": str,
            "size": str,
            "digest": str,
            "type": str,
            "description": str,
            "tags": [str],
            "capabilities": [str],
            "parameters": str,
            "details": {
                "parent_model": str,
                "format": str,
                "family": str,
                "families": [str],
                "parameter_size": str,
                "quantization_level": str,
            },
        }
    ],
    "object": str,
    "data": [
        {
            "id": str,
            "aliases": [str],
            "tags": [str],
            "object": str,
            "created": int,
            "owned_by": str,
            "meta": {
                "vocab_type": int,
                "n_vocab": int,
                "n_ctx": int,
                "n_ctx_train": int,
                "n_embd": int,
                "n_params": int,
                "size": int,
                "ftype": str,
            },
        }
    ],
}

HEALTH = {"status": str}  # the /health handler: {"status": "ok"}, 200
ERROR = {"error": {"message": str, "type": str, "code": int}}  # format_error_response; the loading middleware's

METRICS = {  # server_task_result_metrics::to_metrics: llamacpp:<name> -> its TYPE
    **{
        name: "counter"
        for name in (
            "prompt_tokens_total",
            "prompt_tokens_cached_total",
            "prompt_seconds_total",
            "tokens_predicted_total",
            "tokens_predicted_seconds_total",
            "n_decode_total",
            "n_tokens_max",
            "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total",
            "spec_decode_num_drafts_total",
        )
    },
    **{
        name: "gauge"
        for name in (
            "prompt_tokens_seconds",
            "predicted_tokens_seconds",
            "requests_processing",
            "requests_deferred",
            "n_busy_slots_per_decode",
        )
    },
}


def mismatches(value: Any, shape: Any, path: str = "$") -> list[str]:
    """Where ``value`` is not a superset of ``shape``: a dict shape's keys must be there with their shapes, a
    one-element list shape is an array whose every element has that shape, a type is the JSON type (bool is
    not an integer, an integer is not a float)."""
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return [f"{path}: an object expected, got {type(value).__name__}"]
        out = []
        for key, sub in shape.items():
            if key not in value:
                out.append(f"{path}.{key}: missing")
            else:
                out += mismatches(value[key], sub, f"{path}.{key}")
        return out
    if isinstance(shape, list):
        if not isinstance(value, list):
            return [f"{path}: an array expected, got {type(value).__name__}"]
        return [m for i, item in enumerate(value) for m in mismatches(item, shape[0], f"{path}[{i}]")]
    ok = type(value) is shape  # exact: True is no int, 1 no float
    return [] if ok else [f"{path}: {shape.__name__} expected, got {type(value).__name__} {value!r}"]


def test_the_comparison_sees_types_and_keys() -> None:
    assert mismatches({"a": 1, "b": [{"c": 1.0}], "x": 0}, {"a": int, "b": [{"c": float}]}) == []
    assert mismatches({"a": True}, {"a": int}) == ["$.a: int expected, got bool True"]
    assert mismatches({"a": 1}, {"a": float}) == ["$.a: float expected, got int 1"]
    assert mismatches({"b": {"c": 1}}, {"b": [{"c": int}]}) == ["$.b: an array expected, got dict"]
    assert mismatches({}, {"a": int}) == ["$.a: missing"]


# --------------------------------------------------------------------------- one node, two slots


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, list[tuple[int, Any]]]]:
    """A node with two slots and ``--props``, and the ``/health`` replies seen while it loaded."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("shapes") / "server.log", "--parallel", "2", "--ctx-size", "1024", "--props"
    )
    seen: list[tuple[int, Any]] = []
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            try:
                r = httpx.get(srv.base + "/health", timeout=10)
            except httpx.TransportError:
                assert srv.proc.poll() is None, srv.log()
                time.sleep(0.005)
                continue
            seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
        assert seen and seen[-1][0] == 200, f"not ready: {seen[-3:]}\n{srv.log()}"
        yield srv, seen
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.fixture
def client(node: tuple[ServerProcess, Any]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node[0].base, timeout=120) as c:
        yield c


def test_health_while_loading_and_ready(node: tuple[ServerProcess, list[tuple[int, Any]]]) -> None:
    _, seen = node
    code, ready = seen[-1]
    assert code == 200 and mismatches(ready, HEALTH) == [] and ready["status"] == "ok"
    loading = [body for code, body in seen if code == 503]
    assert loading, "no reply seen while the model loaded"
    for body in loading:  # llama-server's loading middleware: {"error": {"message": "Loading model", ...}}, 503
        assert mismatches(body, ERROR) == [], body
        assert body["error"] == {"message": "Loading model", "type": "unavailable_error", "code": 503}


def test_slots_before_and_after_a_task(client: httpx.Client) -> None:
    """Module order matters: this runs first on the node's slots, so both have never had a task."""
    before = client.get("/slots").json()
    assert [s["id"] for s in before] == [0, 1]
    for s in before:
        assert mismatches(s, SLOT) == [], s
        assert s["speculative"] is False and s["is_processing"] is False and s["n_past"] == 0  # the node's n_past
        assert "params" not in s  # llama-server sends a task's params once the slot has had one
    r = client.post("/completion", json={"prompt": "The capital of France is", "n_predict": 4, "id_slot": 0})
    assert r.status_code == 200, r.text
    n_prompt = r.json()["tokens_evaluated"]
    after = client.get("/slots").json()
    s0, s1 = after
    assert mismatches(s0, SLOT_WITH_TASK) == [], mismatches(s0, SLOT_WITH_TASK)
    assert mismatches(s1, SLOT) == [] and "params" not in s1
    # what llama-server's slot shows after release: its last task, counts reset, the cache kept
    assert s0["is_processing"] is False and s0["id_task"] >= 0 and len(s0["next_token"]) == 1
    assert s0["next_token"][0] == {"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}
    assert (s0["n_prompt_tokens_processed"], s0["n_prompt_tokens_cache"]) == (0, 0)
    assert s0["n_prompt_tokens"] == s0["n_past"] >= n_prompt  # the slot's cache: prompt + what was generated
    assert s0["params"]["n_predict"] == s0["params"]["max_tokens"] == 4 and s0["params"]["stream"] is False
    # a second task on the slot is a new task
    client.post("/completion", json={"prompt": "The capital of Italy is", "n_predict": 2, "id_slot": 0})
    again = client.get("/slots").json()[0]
    assert again["id_task"] > s0["id_task"] and again["params"]["n_predict"] == 2


def test_a_processing_slot_and_fail_on_no_slot(node: tuple[ServerProcess, Any], client: httpx.Client) -> None:
    base = node[0].base
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    assert client.get("/slots", params={"fail_on_no_slot": "1"}).status_code == 200
    with streaming(base, {**body, "id_slot": 0}):
        busy = next(s for s in client.get("/slots").json() if s["id"] == 0)
        assert mismatches(busy, SLOT_WITH_TASK) == [], mismatches(busy, SLOT_WITH_TASK)
        nt = busy["next_token"][0]
        assert busy["is_processing"] is True and nt["has_next_token"] is True
        assert nt["n_remain"] == 4000 - nt["n_decoded"] and busy["params"]["stream"] is True
        assert busy["params"]["ignore_eos"] is True and busy["params"]["temperature"] == 0.0
        assert busy["n_prompt_tokens_processed"] + busy["n_prompt_tokens_cache"] >= 1
        # one slot is idle: no failure
        assert client.get("/slots", params={"fail_on_no_slot": "1"}).status_code == 200
        with streaming(base, {**body, "id_slot": 1}):
            r = client.get("/slots", params={"fail_on_no_slot": "1"})
            assert r.status_code == 503 and mismatches(r.json(), ERROR) == []
            assert r.json()["error"] == {"message": "no slot available", "type": "unavailable_error", "code": 503}
            assert client.get("/slots", params={"fail_on_no_slot": ""}).status_code == 200  # empty: not asked
            assert client.get("/slots").status_code == 200


def test_props_shape_and_values(client: httpx.Client) -> None:
    props = client.get("/props").json()
    assert mismatches(props, PROPS) == [], mismatches(props, PROPS)
    params = props["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_k"], params["n_predict"], params["stream"]) == (0.8, 40, -1, False)
    assert params["samplers"][0] == "penalties" and params["lora"] == []
    assert props["total_slots"] == 2
    assert props["default_generation_settings"]["n_ctx"] == client.get("/slots").json()[0]["n_ctx"] > 0
    assert props["model_ftype"] == "Q4_1"  # SmolLM2-135M-Instruct.Q4_1.gguf
    caps = props["chat_template_caps"]  # SmolLM2's template writes every message's content, and no tools
    assert caps["supports_string_content"] and caps["supports_system_role"] and not caps["supports_tools"]
    assert props["endpoint_props"] is True and props["media_marker"].startswith("<__media_")


def test_models_shape_and_values(client: httpx.Client) -> None:
    for path in ("/v1/models", "/models"):
        body = client.get(path).json()
        assert mismatches(body, MODELS) == [], mismatches(body, MODELS)
        (model,), (listed,) = body["data"], body["models"]
        assert model["id"] == listed["name"] == listed["model"] == "smollm2-135m" and body["object"] == "list"
        meta = model["meta"]
        assert meta["n_vocab"] == 49152 and meta["ftype"] == "Q4_1"
        assert meta["n_ctx"] == client.get("/props").json()["default_generation_settings"]["n_ctx"]
        assert meta["n_embd"] == 576 and meta["n_ctx_train"] == 8192 and meta["n_params"] > 100_000_000
        assert model["status"]["value"] == "loaded" and meta["model_hash"]  # the node's own keys stay


TOOLS_TEMPLATE = r"""{%- if tools %}<|im_start|>system
<tools>{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}</tools><|im_end|>
{%- endif %}
{%- for message in messages %}{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", "arguments": {{
call.function.arguments | tojson }}}</tool_call>{%- endfor %}<|im_end|>
{%- elif message.content is string %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{%- else %}<|im_start|>{{ message.role }}
{%- for part in message.content %}{{ part.text }}{%- endfor %}<|im_end|>
{%- endif %}{%- endfor %}"""
"""A Hermes-style template: tools, tool calls with object arguments, typed content; no reasoning."""


def test_chat_template_caps_of_three_templates() -> None:
    from hydra_trio.engine.llama.model import ChatTemplate
    from hydra_trio.openai.template_caps import template_caps

    from .test_thinking import TEMPLATE as THINKING  # writes earlier turns' reasoning, reads reasoning_effort

    tools = template_caps(ChatTemplate.jinja(TOOLS_TEMPLATE, "<s>", "</s>", "test"))
    assert mismatches(tools, CAPS) == []
    assert {k for k, v in tools.items() if not v} == {"supports_preserve_reasoning", "supports_reasoning_effort"}
    thinking = template_caps(ChatTemplate.jinja(THINKING, "<s>", "</s>", "test"))
    assert {k for k, v in thinking.items() if v} == {
        "supports_string_content",
        "supports_system_role",
        "supports_preserve_reasoning",
        "supports_reasoning_effort",
    }
    builtin = template_caps(ChatTemplate.builtin("chatml", "test"))  # llama.cpp's: no variables, no tools
    assert {k for k, v in builtin.items() if v} == {"supports_string_content", "supports_system_role"}


def _families(text: str) -> dict[str, tuple[str, float]]:
    """``llamacpp:`` families of a Prometheus text: name -> (TYPE, the value of its unlabelled sample)."""
    types = dict(re.findall(r"^# TYPE llamacpp:(\S+) (\S+)$", text, re.M))
    values = {name: float(v) for name, v in re.findall(r"^llamacpp:(\S+) (\S+)$", text, re.M)}
    return {name: (kind, values[name]) for name, kind in types.items() if name in values}


def test_metrics_names_and_types(client: httpx.Client) -> None:
    prompt = {"prompt": "A long time ago in a galaxy far, far away, there lived", "n_predict": 2, "id_slot": 0}
    client.post("/completion", json=prompt)
    before = _families(client.get("/metrics").text)
    missing = {name: kind for name, kind in METRICS.items() if before.get(name, ("",))[0] != kind}
    assert missing == {}, f"missing or of another type: {missing}"
    # the same prompt again on the same slot: its tokens come from the slot's cache
    r = client.post("/completion", json=prompt).json()
    after = _families(client.get("/metrics").text)
    cached = after["prompt_tokens_cached_total"][1] - before["prompt_tokens_cached_total"][1]
    assert cached == r["timings"]["cache_n"] > 0
    assert after["n_tokens_max"][1] >= r["tokens_evaluated"] and after["spec_decode_num_drafts_total"][1] == 0


def test_post_props_takes_any_body_and_changes_nothing(client: httpx.Client) -> None:
    """llama-server's ``post_props`` never reads the body: ``{"success": true}`` whatever it is, and no
    property changes.  The body is read, so the connection carries the next request (it was closed)."""
    before = client.get("/props").json()
    for body in (b"not json", b'{"temperature": 0.1, "total_slots": 9}', b"[1, 2", b""):
        r = client.post("/props", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json() == {"success": True}
        assert r.headers.get("connection", "").lower() != "close"
    after = client.get("/props").json()
    assert after["default_generation_settings"] == before["default_generation_settings"]
    assert after["total_slots"] == 2
