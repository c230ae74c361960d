"""llama-server's own parameters (``LLAMA_EXAMPLE_SERVER`` in ``common/arg.cpp``): slots, caching, HTTP,
API keys, chat templates and thinking, plus the preset flags it refuses (the speculative-decoding ones are
:mod:`.speculative`)."""

from __future__ import annotations

import functools

from ..engine.settings import EngineConfig
from . import _types as t
from ._flags import ACCEPTED, REFUSED, WIRED, Flag

NO_RERANK = "this node has no reranking endpoint"
NO_UI = "the node serves its own status page at /, not llama-server's web UI"


V = functools.partial(Flag, group="server")  # a table row of this group


FLAGS: list[Flag] = [
    V(("--kv-unified-per-slot",), WIRED, "the most tokens one slot may hold (default: unset, 0 or less: no cap; "
      "with -kvu a slot may fill the whole cache); given without -c, the KV pool is sized to -np x N", value="N",
      type=t.int_range(-t.INT32_MAX - 1, t.INT32_MAX), env="LLAMA_ARG_KV_UNIFIED_PER_SLOT",
      lands="EngineConfig.llama.kv_unified_per_slot"),
    V(("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"), WIRED, "context checkpoints kept per slot for "
      "recurrent, hybrid and SWA models: a diverging prompt resumes from the latest one instead of being "
      "evaluated whole (default: 32; 0 or less = off)", value="N", type=t.int_at_least(0),
      env="LLAMA_ARG_CTX_CHECKPOINTS", dest="n_ctx_checkpoints", lands="EngineConfig.n_ctx_checkpoints"),
    V(("-cms", "--checkpoint-min-step"), WIRED, "minimum spacing in tokens between context checkpoints of "
      "different requests once a slot's are full (default: 8192; 0 = no minimum)", value="N",
      type=t.int_range(0, t.INT32_MAX), env="LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT", dest="checkpoint_min_step",
      lands="EngineConfig.checkpoint_min_step"),
    V(("-cram", "--cache-ram"), WIRED, "host-RAM prompt cache in MiB: slots' KV states kept by their tokens and "
      "restored for a prompt that starts with them (default: 8192, below 0 = no limit, 0 = off)", value="N",
      type=t.int_at_least(-1), env="LLAMA_ARG_CACHE_RAM", dest="cache_ram_mib",
      lands="EngineConfig.cache_ram_mib"),
    V(("-kvu", "--kv-unified"), WIRED, "one KV buffer shared by every slot; a slot may fill all of it (cap: "
      "--kv-unified-per-slot); when it is full, idle slots make room (-np -1 turns it on, as llama-server)", neg=("-no-kvu", "--no-kv-unified"),
      env="LLAMA_ARG_KV_UNIFIED", lands="EngineConfig.llama.kv_unified"),
    V(("--cache-idle-slots",), WIRED, "keep idle slots' KV states in the prompt cache too, when the node goes "
      "idle (default: on; needs --cache-ram)", neg=("--no-cache-idle-slots",), env="LLAMA_ARG_CACHE_IDLE_SLOTS",
      default=True, lands="EngineConfig.cache_idle_slots"),
    V(("--context-shift",), WIRED, "when a generation fills its slot's context, drop older tokens and go on "
      "(default: off)", neg=("--no-context-shift",), env="LLAMA_ARG_CONTEXT_SHIFT",
      lands="EngineConfig.context_shift"),
    V(("--keep",), WIRED, "prompt tokens kept by a context shift (-1 = all)", value="N",
      type=t.int_range(-1, t.INT32_MAX), dest="n_keep", lands="EngineConfig.n_keep"),
    V(("-r", "--reverse-prompt"), WIRED, "a stop string for every request whose stop list (with its chat "
      "template's) is empty, repeatable (at most 16 of 512 characters)", value="PROMPT", action="append",
      dest="reverse_prompt", lands="EngineConfig.generation.stop"),
    V(("-sp", "--special"), WIRED, "write generated special tokens into the reply's text (default: they add "
      "none)", lands="EngineConfig.generation.special"),
    V(("--warmup",), ACCEPTED, "the node always runs its warm-up step at start",
      neg=("--no-warmup",)),
    V(("--spm-infill",), REFUSED, "/infill is not served (501), so there is no infill prompt order to choose"),
    V(("--pooling",), WIRED, "pooling of embeddings: none, mean, cls, last or rank (default: the model's)",
      value="{none,mean,cls,last,rank}", type=t.choice("none", "mean", "cls", "last", "rank"),
      env="LLAMA_ARG_POOLING", lands="EngineConfig.llama.pooling"),
    V(("-np", "--parallel"), WIRED, "number of slots, 1-256 (below 0 = auto: 4)", value="N",
      type=t.n_parallel, default=EngineConfig.__attrs_attrs__.n_parallel.default, env="LLAMA_ARG_N_PARALLEL",
      lands="EngineConfig.n_parallel"),
    V(("-cb", "--cont-batching"), ACCEPTED, "continuous batching is always on", neg=("-nocb", "--no-cont-batching"),
      env="LLAMA_ARG_CONT_BATCHING"),
    V(("--mmproj-auto",), WIRED, "use the projector of a -m preset that has one (tiny-vision's, kept beside "
      "its model), as llama-server uses the one it finds with -hf; a -m FILE needs -mm (default: on)",
      neg=("--no-mmproj", "--no-mmproj-auto"), default=True, env="LLAMA_ARG_MMPROJ_AUTO",
      lands="EngineConfig.media.mmproj"),
    V(("--mtmd-batch-max-tokens",), WIRED, "most image tokens encoded in one batch (default: 1024)", value="N",
      type=t.int_range(0, t.INT32_MAX), env="LLAMA_ARG_MTMD_BATCH_MAX_TOKENS",
      lands="EngineConfig.media.batch_max_tokens"),
    V(("-a", "--alias"), WIRED, "model id in API replies (default: the preset alias or file name)", value="STRING",
      env="LLAMA_ARG_ALIAS", lands="EngineConfig.model_alias"),
    V(("--tags",), ACCEPTED, "a model's tags are for router mode: a preset's tags are listed by /models", value="STRING", env="LLAMA_ARG_TAGS"),
    V(("--embd-normalize",), WIRED, "normalization of pooled embeddings: -1 none, 0 max absolute (int16), "
      "1 taxicab, 2 Euclidean (default), >2 p-norm", value="N", type=t.int_range(-1, t.INT32_MAX),
      lands="EngineConfig.embd_normalize"),
    V(("--host",), WIRED, "address to bind", value="HOST", default="127.0.0.1", env="LLAMA_ARG_HOST",
      lands="ServerConfig.host"),
    V(("--port",), WIRED, "TCP port for HTTP, Hydra and ggml-RPC, 0-65535 (0 = any free port)", value="PORT",
      type=t.port, default=8080, env="LLAMA_ARG_PORT", lands="ServerConfig.port"),
    V(("--reuse-port",), WIRED, "listen with SO_REUSEPORT: other processes started with it may listen on the "
      "same port, the kernel shares the connections out among them", env="LLAMA_ARG_REUSE_PORT",
      lands="ServerConfig.reuse_port"),
    V(("--path",), REFUSED, NO_UI + "; it serves no other static files", value="PATH", env="LLAMA_ARG_STATIC_PATH"),
    V(("--cors-origins",), WIRED, "comma-separated origins allowed by CORS (default: *)", value="ORIGINS",
      type=t.csv, env="LLAMA_ARG_CORS_ORIGINS", lands="HttpSettings.cors_origins"),
    V(("--cors-methods",), ACCEPTED, "CORS allows every method", value="METHODS", env="LLAMA_ARG_CORS_METHODS"),
    V(("--cors-headers",), ACCEPTED, "CORS allows every header", value="HEADERS", env="LLAMA_ARG_CORS_HEADERS"),
    V(("--cors-credentials",), ACCEPTED, "CORS answers without credentials", neg=("--no-cors-credentials",),
      env="LLAMA_ARG_CORS_CREDENTIALS"),
    V(("--api-prefix",), REFUSED, "the API is served at the root paths only", value="PREFIX",
      env="LLAMA_ARG_API_PREFIX"),
    V(("--ui-config", "--webui-config"), ACCEPTED, NO_UI, value="JSON", env="LLAMA_ARG_UI_CONFIG"),
    V(("--ui-config-file", "--webui-config-file"), ACCEPTED, NO_UI, value="PATH", env="LLAMA_ARG_UI_CONFIG_FILE"),
    V(("--ui-mcp-proxy", "--webui-mcp-proxy"), ACCEPTED, NO_UI, neg=("--no-ui-mcp-proxy", "--no-webui-mcp-proxy"),
      env="LLAMA_ARG_UI_MCP_PROXY"),
    V(("--tools",), REFUSED, "the node runs no server-side tools; clients run their own tool calls",
      value="TOOL1,TOOL2,...", env="LLAMA_ARG_TOOLS"),
    V(("--tools-runtime",), REFUSED, "the node runs no server-side tools", value="OPTION",
      env="LLAMA_ARG_TOOLS_RUNTIME"),
    V(("--mcp-servers-config",), REFUSED, "the node runs no MCP servers", value="PATH",
      env="LLAMA_ARG_MCP_SERVERS_CONFIG"),
    V(("--mcp-servers-json",), REFUSED, "the node runs no MCP servers", value="JSON", env="LLAMA_ARG_MCP_SERVERS_JSON"),
    V(("-ag", "--agent"), ACCEPTED, NO_UI, neg=("-no-ag", "--no-agent"), env="LLAMA_ARG_AGENT"),
    V(("--ui", "--webui"), ACCEPTED, NO_UI, neg=("--no-ui", "--no-webui"), env="LLAMA_ARG_UI"),
    V(("--embedding", "--embeddings"), WIRED, "serve embeddings only: POST /v1/embeddings, /embedding(s); "
      "completions are refused", env="LLAMA_ARG_EMBEDDINGS", lands="EngineConfig.llama.embeddings"),
    V(("--rerank", "--reranking"), REFUSED, NO_RERANK, env="LLAMA_ARG_RERANKING"),
    V(("--api-key",), WIRED, "HTTP: require 'Authorization: Bearer KEY'; a comma-separated list, repeatable; "
      "/health stays open", value="KEY", type=t.key_list, action="append", default=None, env="LLAMA_API_KEY",
      lands="AccessSettings.api_keys"),
    V(("--api-key-file",), WIRED, "HTTP: API keys from a file, one per line (empty lines and # lines skipped)",
      value="FNAME", action="append", default=None, env="LLAMA_ARG_API_KEY_FILE", lands="AccessSettings.api_keys"),
    V(("--ssl-key-file",), WIRED, "PEM private key: serve TLS (HTTPS, and Hydra and ggml-RPC over TLS) on the "
      "same port (= --tls-key)", value="FNAME", env="LLAMA_ARG_SSL_KEY_FILE", dest="tls_key",
      lands="FrontDoorSettings.tls"),
    V(("--ssl-cert-file",), WIRED, "PEM certificate chain for --ssl-key-file (= --tls-cert)", value="FNAME",
      env="LLAMA_ARG_SSL_CERT_FILE", dest="tls_cert", lands="FrontDoorSettings.tls"),
    V(("--chat-template-kwargs",), WIRED, "extra variables for the Jinja chat template, a JSON object, e.g. "
      "'{\"enable_thinking\": true}'", value="STRING", type=t.json_object, env="LLAMA_ARG_CHAT_TEMPLATE_KWARGS",
      lands="EngineConfig.chat_template_kwargs"),
    V(("-to", "--timeout"), WIRED, "HTTP read/write timeout in seconds, as llama-server's: silence allowed while a "
      "request body arrives (408 after), and time a reply may wait for a client that reads none of it (the "
      "connection closes); 0: no waiting (only what the client has already sent, or what the socket takes at "
      "once), below 0: no limit (default: 3600). A reply runs as long as it needs", value="SECONDS",
      type=t.timeout_seconds, env="LLAMA_ARG_TIMEOUT", lands="HttpSettings.body_timeout, .write_timeout"),
    V(("--sse-ping-interval",), ACCEPTED, "streams send no SSE pings", value="N", type=t.int_range(-1, t.INT32_MAX),
      env="LLAMA_ARG_SSE_PING_INTERVAL"),
    V(("--threads-http",), ACCEPTED, "HTTP is served by trio tasks, not a thread pool", value="N",
      type=t.int_range(-1, t.INT32_MAX), env="LLAMA_ARG_THREADS_HTTP"),
    V(("--cache-prompt",), WIRED, "reuse a slot's cached prefix, for every request that sends no cache_prompt "
      "(default: on)", neg=("--no-cache-prompt",), default=True, env="LLAMA_ARG_CACHE_PROMPT", dest="cache_prompt",
      lands="EngineConfig.generation.cache_prompt"),
    V(("--cache-reuse",), WIRED, "minimum chunk of cached tokens to reuse by shifting the KV cache (0 or less = off)",
      value="N", type=t.int_at_least(0), env="LLAMA_ARG_CACHE_REUSE", dest="n_cache_reuse",
      lands="EngineConfig.n_cache_reuse"),
    V(("--metrics",), ACCEPTED, "/metrics is always on", env="LLAMA_ARG_ENDPOINT_METRICS"),
    V(("--props",), WIRED, "offer POST /props (as llama-server at this version it sets no property: "
      "{\"success\": true}; 501 without the flag); GET /props is always on; properties change through "
      "the Hydra CONFIGURE op", env="LLAMA_ARG_ENDPOINT_PROPS", dest="endpoint_props",
      lands="HttpSettings.endpoint_props"),
    V(("--slots",), ACCEPTED, "/slots is always on (the cluster's health checker probes it)", neg=("--no-slots",),
      env="LLAMA_ARG_ENDPOINT_SLOTS"),
    V(("--slot-save-path",), WIRED, "directory for POST /slots/{id}?action=save|restore", value="PATH",
      type=t.directory, lands="EngineConfig.slot_save_path"),
    V(("--media-path",), WIRED, "directory that file:// URLs of media parts are read from, names relative to "
      "it (default: such URLs are refused)", value="PATH", type=t.existing_directory,
      lands="EngineConfig.media.media_path"),
    V(("--models-dir",), WIRED, "router mode (no -m): every GGUF of this directory is a model (a folder holding "
      "one with its mmproj-*.gguf is one model), as llama-server", value="PATH", type=t.existing_directory,
      env="LLAMA_ARG_MODELS_DIR", lands="RouterSettings.models"),
    V(("--models-preset",), WIRED, "router mode (no -m): the models are the sections of this INI file, keys are "
      "flags, as llama-server (docs/router.md)", value="PATH", type=t.existing_file,
      env="LLAMA_ARG_MODELS_PRESET", lands="RouterSettings.models"),
    V(("--models-max",), WIRED, "router mode: most models loaded at once; loading one more first unloads the "
      "least recently used idle one (default: 4, 0 = unlimited)", value="N", type=t.int_range(0, t.INT32_MAX),
      default=4, env="LLAMA_ARG_MODELS_MAX", lands="RouterSettings.models_max"),
    V(("--models-autoload",), WIRED, "router mode: a request for a model that is not loaded loads it (default: on; "
      "a request's ?autoload=true|false decides for itself)", neg=("--no-models-autoload",), default=True,
      env="LLAMA_ARG_MODELS_AUTOLOAD", lands="RouterSettings.models_autoload"),
    V(("--jinja",), ACCEPTED, "chat templates are always Jinja (the GGUF's, --chat-template or a built-in)",
      neg=("--no-jinja",), env="LLAMA_ARG_JINJA"),
    V(("--reasoning-format",), WIRED, "how chat replies are split: none (thinking stays in content), deepseek "
      "(thinking in reasoning_content), deepseek-legacy (tags kept in content, reasoning_content filled too), auto "
      "(deepseek when the template thinks; default)", value="FORMAT",
      type=t.choice("none", "deepseek", "deepseek-legacy", "auto"), env="LLAMA_ARG_THINK",
      lands="EngineConfig.reasoning_format"),
    V(("-rea", "--reasoning"), WIRED, "thinking on, off or auto: on/off set enable_thinking for the chat "
      "template, as llama-server", value="[on|off|auto]", type=t.on_off_auto, env="LLAMA_ARG_REASONING",
      lands="EngineConfig.chat_template_kwargs"),
    V(("--reasoning-effort",), WIRED, "reasoning effort given to the chat template as its reasoning_effort "
      "variable ('default' keeps the template's), as llama-server", value="LEVEL", env="LLAMA_ARG_REASONING_EFFORT",
      lands="EngineConfig.chat_template_kwargs"),
    V(("--reasoning-budget",), WIRED, "thinking budget in tokens: -1 unrestricted (default), 0 no thinking "
      "(enable_thinking false for the template), N > 0: after N tokens inside the thinking block its end marker "
      "is forced and the model answers", value="N", type=t.int_range(-1, t.INT32_MAX),
      env="LLAMA_ARG_THINK_BUDGET", lands="EngineConfig.reasoning_budget"),
    V(("--reasoning-budget-message",), WIRED, "text forced before the end-of-thinking marker when the thinking "
      "budget is spent (default: none)", value="MESSAGE", env="LLAMA_ARG_THINK_BUDGET_MESSAGE",
      lands="EngineConfig.reasoning_budget_message"),
    V(("--reasoning-preserve",), WIRED, "keep past thinking in the history: the template variable "
      "preserve_reasoning (default: on, as llama-server), from which preserve_thinking, clear_thinking, "
      "truncate_history_thinking and drop_thinking follow for templates that read them",
      neg=("--no-reasoning-preserve",), env="LLAMA_ARG_REASONING_PRESERVE", extra={"default": None},
      lands="EngineConfig.chat_template_kwargs"),
    V(("--chat-template",), WIRED, "chat template: a built-in name (hydra-trio models templates), a Jinja file "
      "or Jinja text (default: the GGUF's; chatml when it has none)", value="JINJA_TEMPLATE",
      type=t.chat_template_value, env="LLAMA_ARG_CHAT_TEMPLATE", lands="EngineConfig.chat_template"),
    V(("--chat-template-file",), WIRED, "a Jinja chat template file", value="JINJA_TEMPLATE_FILE",
      type=t.chat_template_file, env="LLAMA_ARG_CHAT_TEMPLATE_FILE", lands="EngineConfig.chat_template"),
    V(("--skip-chat-parsing",), WIRED, "a chat reply is content whole: thinking is not split into "
      "reasoning_content, tool calls are neither parsed nor constrained by a grammar (default: off)",
      neg=("--no-skip-chat-parsing",), env="LLAMA_ARG_SKIP_CHAT_PARSING", lands="EngineConfig.skip_chat_parsing"),
    V(("--prefill-assistant",), ACCEPTED, "a final assistant message is rendered as a closed turn and the reply "
      "starts a new one, as llama-server's --no-prefill-assistant; continuing that message is not supported yet",
      neg=("--no-prefill-assistant",), env="LLAMA_ARG_PREFILL_ASSISTANT"),
    V(("-sps", "--slot-prompt-similarity"), WIRED, "how much a prompt must match a slot's cached prompt to use "
      "that slot (0.0 = off)", value="SIMILARITY", type=t.float_range(0.0, 1.0), dest="slot_prompt_similarity",
      lands="EngineConfig.slot_prompt_similarity"),
    V(("--lora-init-without-apply",), REFUSED, "LoRA adapters are not supported"),
    V(("--sleep-idle-seconds",), REFUSED, "the node keeps its model loaded; it does not sleep", value="SECONDS"),
    V(("--log-prompts-dir",), REFUSED, "prompts are not logged to files", value="PATH"),
    # llama-server's presets download models from Hugging Face
    *(V((name,), REFUSED, "a preset that downloads a model from Hugging Face; " + "give -m FILE")
      for name in ("--embd-gemma-default", "--fim-qwen-1.5b-default", "--fim-qwen-3b-default",
                   "--fim-qwen-7b-default", "--fim-qwen-7b-spec", "--fim-qwen-14b-spec", "--fim-qwen-30b-default",
                   "--gpt-oss-20b-default", "--gpt-oss-120b-default", "--vision-gemma-4b-default",
                   "--vision-gemma-12b-default")),
]

