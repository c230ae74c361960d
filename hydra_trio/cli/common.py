"""llama-server's common parameters (``common/arg.cpp`` options for every tool): model, context, CPU,
devices and offload, KV cache, RoPE, logs.  See :mod:`._flags` for the four classes."""

from __future__ import annotations

import functools

from ..engine.settings import EngineConfig
from . import _types as t
from ._flags import ACCEPTED, OWN, REFUSED, WIRED, Flag

NO_DOWNLOADS = "the node loads a local GGUF file or a preset (hydra-trio models); it downloads nothing at run time"
NO_LORA = "LoRA adapters and control vectors are not supported"
NO_VIDEO = "video input is not supported (GET /props modalities.video is false; a video part answers llama-server's error)"
CPU_ONLY_NOTE = "applied when the model loads; without a GPU nothing is offloaded and the log warns once, as llama-server"


F = functools.partial(Flag, group="common")  # a table row of this group


FLAGS: list[Flag] = [
    # -- tool ----------------------------------------------------------------------------------------
    F(("-h", "--help", "--usage"), WIRED, "show this help and exit", action="help", default=None),
    F(("--version",), WIRED, "show the version and exit", action="version", default=None),
    F(("-cl", "--cache-list"), WIRED, "list the installed model presets (this node's model cache; hydra-trio "
      "models lists them all) and exit", lands="(prints and exits)"),
    F(("--completion-bash",), WIRED, "print a source-able bash completion script for hydra-trio's flags and exit",
      lands="(prints and exits)"),
    # -- CPU -----------------------------------------------------------------------------------------
    F(("-t", "--threads"), WIRED, "CPU threads for generation, at most 512; 0 or less: all cores (default: all "
      "cores)", value="N", type=t.threads, env="LLAMA_ARG_THREADS", lands="EngineConfig.n_threads"),
    F(("-tb", "--threads-batch"), WIRED, "CPU threads for prompt processing, at most 512; 0 or less: all cores "
      "(default: same as --threads)", value="N", type=t.threads, dest="threads_batch",
      lands="EngineConfig.llama.n_threads_batch"),
    F(("-C", "--cpu-mask"), WIRED, "CPU affinity mask, hex; applied to the whole process (sched_setaffinity)",
      value="M", type=t.cpu_mask, lands="process affinity"),
    F(("-Cr", "--cpu-range"), WIRED, "CPU affinity range lo-hi; applied to the whole process", value="lo-hi",
      type=t.cpu_range, lands="process affinity"),
    F(("--cpu-strict",), ACCEPTED, "threads are placed by the OS within the affinity mask", value="<0|1>",
      type=t.int_range(t.INT32_MIN, t.INT32_MAX)),
    F(("--prio",), WIRED, "process priority: low(-1), normal(0), medium(1), high(2), realtime(3) (setpriority)",
      value="N", type=t.int_range(-1, 3), lands="process nice value"),
    F(("--poll",), ACCEPTED, "ggml's threadpool polling level is llama.cpp's default", value="<0...100>",
      type=t.int_range(t.INT32_MIN, t.INT32_MAX)),
    F(("-Cb", "--cpu-mask-batch"), ACCEPTED, "one affinity mask (-C/-Cr) serves generation and batches",
      value="M", type=t.cpu_mask),
    F(("-Crb", "--cpu-range-batch"), ACCEPTED, "one affinity range (-C/-Cr) serves generation and batches",
      value="lo-hi", type=t.cpu_range),
    F(("--cpu-strict-batch",), ACCEPTED, "threads are placed by the OS within the affinity mask",
      value="<0|1>", type=t.int_range(t.INT32_MIN, t.INT32_MAX)),
    F(("--prio-batch",), ACCEPTED, "one process priority (--prio) serves generation and batches", value="N",
      type=t.int_range(0, 3)),
    F(("--poll-batch",), ACCEPTED, "ggml's threadpool polling level is llama.cpp's default", value="<0|1>",
      type=t.int_range(t.INT32_MIN, t.INT32_MAX)),
    # -- context and batches -------------------------------------------------------------------------
    F(("-c", "--ctx-size"), WIRED,
      f"total context in tokens (default: {EngineConfig.__attrs_attrs__.n_ctx.default}, or -np x "
      "--kv-unified-per-slot), split evenly over the slots as llama-server does (with -kvu shared); "
      "0 = the model's training context; a slot holds at most the training context", value="N",
      type=t.int_range(0, t.INT32_MAX), env="LLAMA_ARG_CTX_SIZE", lands="EngineConfig.n_ctx"),
    F(("-n", "--predict", "--n-predict"), WIRED, "tokens to generate for a request that sets no max_tokens "
      "(-1 = until end of generation or context)", value="N", type=t.int_range(-1, t.INT32_MAX),
      env="LLAMA_ARG_N_PREDICT", dest="n_predict", lands="EngineConfig.n_predict"),
    F(("-b", "--batch-size"), WIRED, "most tokens per decode step (logical batch)", value="N",
      type=t.int_range(1, t.INT32_MAX), default=EngineConfig.__attrs_attrs__.n_batch.default, env="LLAMA_ARG_BATCH", lands="EngineConfig.n_batch"),
    F(("-ub", "--ubatch-size"), WIRED, "physical batch size (default: --batch-size)", value="N",
      type=t.int_range(1, t.INT32_MAX), env="LLAMA_ARG_UBATCH", lands="EngineConfig.llama.n_ubatch"),
    F(("--swa-full",), WIRED, "a full-size KV cache for sliding-window attention layers",
      env="LLAMA_ARG_SWA_FULL", lands="EngineConfig.llama.swa_full"),
    F(("-fa", "--flash-attn"), WIRED, "flash attention: on, off or auto (default: auto)", value="[on|off|auto]",
      type=t.on_off_auto, env="LLAMA_ARG_FLASH_ATTN", lands="EngineConfig.llama.flash_attn"),
    F(("--perf",), ACCEPTED, "timings are always measured and reported", neg=("--no-perf",),
      env="LLAMA_ARG_PERF"),
    F(("-e", "--escape"), WIRED, "process escape sequences (\\n, \\r, \\t, \\', \\\", \\\\, \\xNN) in -r and "
      "--dry-sequence-breaker (default: on)", neg=("--no-escape",), default=True, dest="escape",
      lands="EngineConfig.generation.stop, .sampling.dry_sequence_breakers"),
    # -- RoPE ----------------------------------------------------------------------------------------
    F(("--rope-scaling",), WIRED, "RoPE scaling: none, linear or yarn (default: the model's)",
      value="{none,linear,yarn}", type=t.choice("none", "linear", "yarn"), env="LLAMA_ARG_ROPE_SCALING_TYPE",
      lands="EngineConfig.llama.rope_scaling"),
    F(("--rope-scale",), WIRED, "RoPE context scaling factor (sets --rope-freq-scale to 1/N)", value="N",
      type=t.float_range(0.0), env="LLAMA_ARG_ROPE_SCALE", lands="EngineConfig.llama.rope_freq_scale"),
    F(("--rope-freq-base",), WIRED, "RoPE base frequency (default: the model's)", value="N",
      type=t.float_range(0.0), env="LLAMA_ARG_ROPE_FREQ_BASE", lands="EngineConfig.llama.rope_freq_base"),
    F(("--rope-freq-scale",), WIRED, "RoPE frequency scaling factor (default: the model's)", value="N",
      type=t.float_range(0.0), env="LLAMA_ARG_ROPE_FREQ_SCALE", lands="EngineConfig.llama.rope_freq_scale"),
    F(("--yarn-orig-ctx",), WIRED, "YaRN: the model's original context (default: its training context)",
      value="N", type=t.int_range(0, t.INT32_MAX), env="LLAMA_ARG_YARN_ORIG_CTX",
      lands="EngineConfig.llama.yarn_orig_ctx"),
    F(("--yarn-ext-factor",), WIRED, "YaRN extrapolation mix factor (-1 = the model's)", value="N",
      type=t.float_range(-1.0), env="LLAMA_ARG_YARN_EXT_FACTOR", lands="EngineConfig.llama.yarn_ext_factor"),
    F(("--yarn-attn-factor",), WIRED, "YaRN attention magnitude scale (-1 = the model's)", value="N",
      type=t.float_range(-1.0), env="LLAMA_ARG_YARN_ATTN_FACTOR", lands="EngineConfig.llama.yarn_attn_factor"),
    F(("--yarn-beta-slow",), WIRED, "YaRN high correction dim or alpha (-1 = the model's)", value="N",
      type=t.float_range(-1.0), env="LLAMA_ARG_YARN_BETA_SLOW", lands="EngineConfig.llama.yarn_beta_slow"),
    F(("--yarn-beta-fast",), WIRED, "YaRN low correction dim or beta (-1 = the model's)", value="N",
      type=t.float_range(-1.0), env="LLAMA_ARG_YARN_BETA_FAST", lands="EngineConfig.llama.yarn_beta_fast"),
    # -- KV cache ------------------------------------------------------------------------------------
    F(("-kvo", "--kv-offload"), WIRED, "KV cache offload to the GPU (default: on)", neg=("-nkvo", "--no-kv-offload"),
      default=True, env="LLAMA_ARG_KV_OFFLOAD", lands="EngineConfig.llama.kv_offload"),
    F(("--repack",), WIRED, "weight repacking for faster CPU kernels (default: on)", neg=("-nr", "--no-repack"),
      default=True, env="LLAMA_ARG_REPACK", lands="EngineConfig.llama.repack"),
    F(("--no-host",), WIRED, "bypass host buffers for the weights (llama.cpp's no_host)", env="LLAMA_ARG_NO_HOST",
      lands="EngineConfig.llama.no_host"),
    F(("-ctk", "--cache-type-k"), WIRED, "KV cache type of K: " + ", ".join(t.KV_CACHE_TYPES) + " (default: f16)",
      value="TYPE", type=t.cache_type, env="LLAMA_ARG_CACHE_TYPE_K", lands="EngineConfig.llama.cache_type_k"),
    F(("-ctv", "--cache-type-v"), WIRED, "KV cache type of V (a quantized V needs flash attention: with -fa off "
      "it is refused at start, exit 2; default: f16)", value="TYPE", type=t.cache_type, env="LLAMA_ARG_CACHE_TYPE_V",
      lands="EngineConfig.llama.cache_type_v"),
    F(("-dt", "--defrag-thold"), ACCEPTED, "deprecated in llama.cpp; the KV cache needs no defragmentation",
      value="N", type=t.float_range(), env="LLAMA_ARG_DEFRAG_THOLD"),
    # -- multimodal ----------------------------------------------------------------------------------
    F(("-mm", "--mmproj"), WIRED, "multimodal projector GGUF (images, audio) for the model (default: a preset's "
      "own, see --mmproj-auto); the node reads its encoders' kinds at start (GET /props modalities)", value="FILE",
      type=t.existing_file, env="LLAMA_ARG_MMPROJ", lands="EngineConfig.media.mmproj"),
    F(("-mmu", "--mmproj-url"), REFUSED, "downloads the projector; " + NO_DOWNLOADS + ": give -mm FILE",
      value="URL", env="LLAMA_ARG_MMPROJ_URL"),
    F(("--mmproj-offload",), WIRED, "the projector on the GPU (default: on; without a GPU nothing is offloaded)",
      neg=("--no-mmproj-offload",), default=True, env="LLAMA_ARG_MMPROJ_OFFLOAD", lands="EngineConfig.media.offload"),
    F(("-mmdev", "--mmproj-device"), WIRED, "the projector's device (none = not offloaded; default: the first of "
      "--device); one device this machine has, else refused at start", value="DEVICE", type=t.mmproj_device,
      env="MTMD_BACKEND_DEVICE", lands="EngineConfig.media.device"),
    F(("--image-min-tokens",), WIRED, "fewest tokens an image may take, for vision models with dynamic resolution "
      "(default: the projector's)", value="N", type=t.int_range(0, t.INT32_MAX), env="LLAMA_ARG_IMAGE_MIN_TOKENS",
      lands="EngineConfig.media.image_min_tokens"),
    F(("--image-max-tokens",), WIRED, "most tokens an image may take, for vision models with dynamic resolution "
      "(default: the projector's)", value="N", type=t.int_range(0, t.INT32_MAX), env="LLAMA_ARG_IMAGE_MAX_TOKENS",
      lands="EngineConfig.media.image_max_tokens"),
    F(("--video-fps",), ACCEPTED, NO_VIDEO, value="N", type=t.float_range(), env="LLAMA_ARG_VIDEO_FPS"),
    F(("--video-timestamp-interval",), ACCEPTED, NO_VIDEO, value="N", type=t.int_range(t.INT32_MIN, t.INT32_MAX),
      env="LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL"),
    F(("--video-ffmpeg-dir",), ACCEPTED, NO_VIDEO, value="DIR", env="LLAMA_ARG_VIDEO_FFMPEG_DIR"),
    # -- devices and placement -----------------------------------------------------------------------
    F(("--rpc",), REFUSED, "layers are not split over --rpc servers; use --rpc-engine HOST:PORT (COMBINED: the "
      "MoE experts on a peer) or the Hydra PIPELINE_ATTACH op", value="SERVERS", env="LLAMA_ARG_RPC"),
    F(("-lm", "--load-mode"), WIRED, "model loading: auto, none, mmap, mlock, mmap+mlock, dio (default: auto)",
      value="MODE", type=t.choice("auto", "none", "mmap", "mlock", "mmap+mlock", "dio"),
      env="LLAMA_ARG_LOAD_MODE", lands="EngineConfig.llama.load_mode"),
    F(("-lzm", "--lazy-mode"), ACCEPTED, "tensors are read as llama.cpp's default (auto) does", value="MODE",
      type=t.choice("on", "auto", "off"), env="LLAMA_ARG_LAZY_MODE"),
    F(("--numa",), WIRED, "NUMA optimizations: distribute (also ''), isolate or numactl (ggml's strategy, set once "
      "per process)", value="TYPE", type=t.choice("distribute", "isolate", "numactl", ""), env="LLAMA_ARG_NUMA",
      lands="EngineConfig.llama.numa"),
    F(("-dev", "--device"), WIRED, "devices for offloading, comma-separated (none = no offloading); a device "
      "this machine does not have, or the CPU, is refused at start", value="<dev1,dev2,..>", type=t.csv, env="LLAMA_ARG_DEVICE",
      lands="EngineConfig.llama.devices"),
    F(("--list-devices",), WIRED, "print the devices this build finds, then exit", lands="(prints and exits)"),
    F(("-ot", "--override-tensor"), WIRED, "tensor buffer type overrides PATTERN=BUFT,... (CPU, CUDA0, ...: a "
      "buffer type of this machine's devices; first match wins, before COMBINED's pattern, -cmoe, -ncmoe)", value="<tensor name pattern>=<buffer type>,...", type=t.tensor_overrides,
      action="append", env="LLAMA_ARG_OVERRIDE_TENSOR", lands="EngineConfig.llama.tensor_overrides"),
    F(("-cmoe", "--cpu-moe"), WIRED, "keep every MoE expert tensor in host memory", env="LLAMA_ARG_CPU_MOE",
      lands="EngineConfig.llama.cpu_moe"),
    F(("-ncmoe", "--n-cpu-moe"), WIRED, "keep the MoE expert tensors of the first N layers in host memory",
      value="N", type=t.int_range(0, t.INT32_MAX), env="LLAMA_ARG_N_CPU_MOE", lands="EngineConfig.llama.n_cpu_moe"),
    F(("-ncffn", "--n-cpu-ffn"), WIRED, "keep the FFN tensors of the first N layers in host memory", value="N",
      type=t.int_range(0, t.INT32_MAX), env="LLAMA_ARG_N_CPU_FFN", lands="EngineConfig.llama.n_cpu_ffn"),
    F(("-ngl", "--gpu-layers", "--n-gpu-layers"), WIRED, "layers to offload to the GPU: N, all or auto; "
      + CPU_ONLY_NOTE, value="N", type=t.gpu_layers, env="LLAMA_ARG_N_GPU_LAYERS",
      lands="EngineConfig.llama.n_gpu_layers"),
    F(("-sm", "--split-mode"), WIRED, "how to split the model over GPUs: none, layer, row, tensor; " + CPU_ONLY_NOTE,
      value="{none,layer,row,tensor}", type=t.choice("none", "layer", "row", "tensor"), env="LLAMA_ARG_SPLIT_MODE",
      lands="EngineConfig.llama.split_mode"),
    F(("-ts", "--tensor-split"), WIRED, "fraction of the model per GPU, e.g. 3,1; " + CPU_ONLY_NOTE,
      value="N0,N1,N2,...", type=t.tensor_split, env="LLAMA_ARG_TENSOR_SPLIT", lands="EngineConfig.llama.tensor_split"),
    F(("-mg", "--main-gpu"), WIRED, "the GPU for the whole model (split-mode none) or intermediate results; "
      + CPU_ONLY_NOTE, value="INDEX", type=t.int_range(t.INT32_MIN, t.INT32_MAX), env="LLAMA_ARG_MAIN_GPU",
      lands="EngineConfig.llama.main_gpu"),
    F(("-fit", "--fit"), ACCEPTED, "there is no device memory to fit the model into (CPU only)", value="[on|off]",
      type=t.on_off, env="LLAMA_ARG_FIT"),
    F(("-fitt", "--fit-target"), ACCEPTED, "there is no device memory to fit the model into (CPU only)",
      value="MiB0,MiB1,MiB2,...", type=t.csv, env="LLAMA_ARG_FIT_TARGET"),
    F(("-fitc", "--fit-ctx"), ACCEPTED, "there is no device memory to fit the model into (CPU only)", value="N",
      type=t.int_range(t.INT32_MIN, t.INT32_MAX), env="LLAMA_ARG_FIT_CTX"),
    F(("--check-tensors",), WIRED, "check the model's tensor data for invalid values while loading",
      lands="EngineConfig.llama.check_tensors"),
    F(("--override-kv",), WIRED, "override GGUF metadata by key when the model loads, repeatable; types int, "
      "float, bool, str, e.g. tokenizer.ggml.add_bos_token=bool:false", value="KEY=TYPE:VALUE,...",
      type=t.kv_overrides, action="append", lands="EngineConfig.llama.kv_overrides"),
    F(("--op-offload",), WIRED, "offload host tensor operations to the device (default: on)",
      neg=("--no-op-offload",), default=True, lands="EngineConfig.llama.op_offload"),
    F(("--lora",), REFUSED, NO_LORA, value="FNAME"),
    F(("--lora-scaled",), REFUSED, NO_LORA, value="FNAME:SCALE,..."),
    F(("--control-vector",), REFUSED, NO_LORA, value="FNAME"),
    F(("--control-vector-scaled",), REFUSED, NO_LORA, value="FNAME:SCALE,..."),
    F(("--control-vector-layer-range",), REFUSED, NO_LORA, value="START"),
    # -- model ---------------------------------------------------------------------------------------
    F(("-m", "--model"), WIRED, "GGUF file or preset alias (hydra-trio models lists them; default: smollm2-135m)", value="PATH|ALIAS",
      env="LLAMA_ARG_MODEL", lands="EngineConfig.model_path"),
    F(("-mu", "--model-url"), REFUSED, NO_DOWNLOADS, value="MODEL_URL", env="LLAMA_ARG_MODEL_URL"),
    F(("-dr", "--docker-repo"), REFUSED, NO_DOWNLOADS, value="[<repo>/]<model>[:quant]", env="LLAMA_ARG_DOCKER_REPO"),
    F(("-hf", "-hfr", "--hf-repo"), REFUSED, NO_DOWNLOADS, value="<user>/<model>[:quant]", env="LLAMA_ARG_HF_REPO"),
    F(("-hff", "--hf-file"), REFUSED, NO_DOWNLOADS, value="FILE", env="LLAMA_ARG_HF_FILE"),
    F(("-hft", "--hf-token"), ACCEPTED, "the node downloads nothing, so it needs no Hugging Face token",
      value="TOKEN"),
    # -- logs ----------------------------------------------------------------------------------------
    F(("--log-disable",), WIRED, "no log output", lands="logging"),
    F(("--log-file",), WIRED, "also write the log to FNAME", value="FNAME", env="LLAMA_ARG_LOG_FILE",
      lands="logging"),
    F(("--log-jsonl",), WIRED, "log lines as JSON objects (= --log-format json)", neg=("--no-log-jsonl",),
      env="LLAMA_ARG_LOG_JSONL", lands="logging"),
    F(("--log-colors",), ACCEPTED, "log lines are plain text (progress bars use colour on a terminal)",
      value="[on|off|auto]", type=t.on_off_auto, env="LLAMA_ARG_LOG_COLORS"),
    F(("-v", "--verbose", "--log-verbose"), WIRED, "log everything (= --log-level DEBUG)", dest="verbose",
      lands="logging"),
    F(("--offline",), ACCEPTED, "the node never goes online for models", env="LLAMA_ARG_OFFLINE"),
    F(("-lv", "--verbosity", "--log-verbosity"), WIRED, "verbosity threshold: 0 generic, 1 error, 2 warning, "
      "3 info, 4 trace, 5 debug (4 and 5 = --log-level DEBUG; below 0: nothing but fatal errors)", value="N",
      type=t.int_range(t.INT32_MIN, t.INT32_MAX),
      env="LLAMA_ARG_LOG_VERBOSITY", dest="log_verbosity", lands="logging"),
    F(("--log-prefix",), ACCEPTED, "every text log line has its level and logger", neg=("--no-log-prefix",),
      env="LLAMA_ARG_LOG_PREFIX"),
    F(("--log-timestamps",), WIRED, "time stamps in text log lines (default: on)", neg=("--no-log-timestamps",),
      default=True, env="LLAMA_ARG_LOG_TIMESTAMPS", lands="logging"),
]
assert all(f.kind != OWN for f in FLAGS)
