"""Configuration dataclasses, validated before any work starts.

A run's config is `Config`; presets (presets.py) give named starting points, YAML files and
dotted overrides (`--model.num_experts=64`) change fields. Every check raises `ConfigError`
naming the field, the bad value and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any


class ConfigError(ValueError):
    """A config value is invalid; the message names the field and what was expected."""


@dataclass
class RouterConfig:
    gating: str = "softmax"  # softmax | sigmoid
    top_k: int = 2
    normalize_top_k: bool = True  # renormalise the k selected weights to sum to 1
    routing: str = "learned"  # learned | random | uniform (random/uniform: system benchmarks)
    lb_loss_weight: float = 0.01
    lb_loss_scope: str = "micro_batch"  # micro_batch | global (global: counts summed over the data-parallel group)
    z_loss_weight: float = 0.001
    expert_bias: bool = False  # auxiliary-loss-free balancing bias (selection only)
    expert_bias_rate: float = 0.001
    # The k routing weights are multiplied by this after normalisation (GLM-4.5, DeepSeek-V3: 2.5), so the routed
    # experts' sum is scaled and the shared expert is not; 1.0 = no multiply.
    routed_scaling_factor: float = 1.0


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # default d_model // num_heads
    qk_norm: bool = False
    attention_bias: bool = False  # biases on the q, k and v projections, none on o (GLM-4.5, Qwen2-MoE)
    rope_theta: float = 10_000.0
    # The leading fraction of each head's dims that RoPE rotates (GLM-4.5: 0.5); the rest pass unrotated.
    rotary_fraction: float = 1.0
    # Sliding-window attention: layer i's window is sliding_window_pattern[i % len(pattern)]; a window w lets a
    # token attend to itself and the w - 1 tokens before it (Hugging Face's sliding_window), 0 = full causal
    # attention. [] = full attention in every layer. OLMo 3: [4096, 4096, 4096, 0].
    sliding_window_pattern: list[int] = field(default_factory=list)
    norm_eps: float = 1e-6
    dense_hidden: int = 512  # hidden size of dense SwiGLU layers
    dense_layers: list[int] = field(default_factory=list)  # indices of dense layers when num_experts > 0
    num_experts: int = 8  # 0 = a dense model
    expert_hidden: int = 128
    shared_expert_hidden: int = 0  # 0 = no shared expert
    # A learned per-token gate on the shared expert's output, sigmoid(x . w) x shared(x) (Qwen1.5-MoE, Qwen2-MoE);
    # needs a shared expert. Off: the shared expert's output is added as it is.
    shared_expert_gate: bool = False
    router: RouterConfig = field(default_factory=RouterConfig)
    tie_embeddings: bool = False
    init_std: float = 0.02
    gemm_backend: str = "auto"  # moe-kernels backend: auto | torch | reference | triton
    precision: str = "bf16"  # moe-precision recipe

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (validate: rotary_fraction x head_dim is whole and even)."""
        return int(self.rotary_fraction * self.resolved_head_dim)

    def attention_window(self, index: int) -> int:
        """Layer index's sliding window (sliding_window_pattern, cycled); 0 = full causal attention."""
        pattern = self.sliding_window_pattern
        return pattern[index % len(pattern)] if pattern else 0

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index not in self.dense_layers

    def __setstate__(self, state: dict) -> None:
        """A config pickled before sliding_window_pattern existed (a Transformer saved with torch.save or pickle
        before 0.26.0) gets its default: a default_factory field has no class attribute to fall back on, so its
        first forward failed with AttributeError. [] is what its writer computed (full attention)."""
        self.__dict__.update(state)
        self.__dict__.setdefault("sliding_window_pattern", [])


@dataclass
class DataConfig:
    path: str = "default"  # "default" = the embedded corpus, else a folder prepared by `prepare-data`
    cache_dir: str = "data"  # where the embedded corpus is tokenized once and kept
    seq_len: int = 128
    seed: int = 0
    eval_fraction: float = 0.02
    default_vocab_size: int = 4096  # BPE vocab trained for the embedded corpus
    default_max_bytes: int = 4_000_000  # how much of the embedded corpus to tokenize

    @staticmethod
    def default_vocab_size_for(model_vocab_size: int) -> int:
        """The embedded corpus's BPE size by default for a model of this vocabulary: DataConfig's own, or the
        model's where that is smaller (the BPE must not emit ids the model cannot embed)."""
        return min(DataConfig.default_vocab_size, model_vocab_size)


@dataclass
class TrainConfig:
    steps: int = 300
    micro_batch_size: int = 8  # sequences per micro-batch per rank
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    # after warmup: cosine | linear (to lr * min_lr_ratio at the end) | constant | wsd (warmup-stable-decay:
    # lr held, then a linear decay to lr * min_lr_ratio over the last lr_decay_fraction of the steps)
    lr_schedule: str = "cosine"
    lr_decay_fraction: float = 0.2  # wsd only
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    eval_interval: int = 50
    eval_windows: int = 64  # eval sequences (spread evenly over the eval split; the same set on every layout)
    log_interval: int = 10
    save_interval: int = 100
    keep_last: int = 2
    async_save: bool = False  # snapshot to host memory, write in a background thread
    run_dir: str = "runs/default"
    resume: bool = True  # continue from run_dir's latest checkpoint when one exists
    # a run starting at step 0 takes its weights from this checkpoint (a run folder, a checkpoint folder or an
    # import-hf output) instead of a random init; optimizer state, step and data order start fresh
    init_from: str | None = None
    device: str = "auto"  # auto | cpu | cuda
    autocast_bf16: bool = True  # bf16 autocast on GPU (never on CPU)
    # none | full (each block recomputed in backward) | mlp (each block's mlp_norm + MoE/SwiGLU recomputed)
    activation_checkpointing: str = "none"
    # torch.compile each block's attention, its norms and a dense layer's SwiGLU, and the loss's cross-entropy;
    # the MoE layers stay eager (their kernels are fused already). Compiled at the first step
    compile: bool = False
    # the LM head and the loss computed this many tokens at a time: the [tokens, vocab] logits and their gradient
    # are never held whole (~20 GB at vocab 100k and 16k tokens a micro-batch). 0 = the whole micro-batch at once
    loss_chunk_tokens: int = 0
    # the LM head's z-loss: this x the mean logsumexp² of the logits is added to the objective (PaLM; OLMo 2 used
    # 1e-5), keeping the softmax's normaliser near 1 for stability; logged as lm_z_loss. 0 = none
    lm_z_loss_weight: float = 0.0
    # attention within documents: a token attends only to the earlier tokens of its own document (the data folder's
    # eos_id ends each), in training and eval; false = causal over the whole window, across document boundaries
    document_masking: bool = False
    # how attention applies the document mask: "flex" (FlexAttention, compiled, with a block mask that skips other
    # documents' keys: a GPU, bf16 / fp16 / fp32, head dims 16-128 that are powers of two), "sdpa"
    # (scaled_dot_product_attention with one additive [B, 1, S, S] mask: everywhere, slower on a GPU) or "auto"
    # (flex where it runs, sdpa elsewhere). H100: flex 69.1K tokens/s, sdpa 63.6K, causal 71.7K (fine-grained-e8)
    document_masking_kernel: str = "auto"
    progress: bool = True
    threads: int = 0  # torch CPU threads; 0 = leave torch's default
    max_skipped_steps: int = 10  # consecutive non-finite steps before the run stops with an error


@dataclass
class ParallelConfig:
    dp: int = 1
    ep: int = 1
    pp: int = 1
    backend: str = "auto"  # auto | gloo | nccl
    strategy: str = "ddp"  # ddp (resident weights) | fsdp (FSDP2 baseline)
    distributed_optimizer: bool = True
    fp32_grad_accum: bool = True
    param_dtype: str = "fp32"  # resident model weights: fp32 | bf16 (fp32 masters live in the optimizer)
    expert_capacity_factor: float = 0.0  # 0 = dropless
    collective_timeout_s: float = 1800.0  # a collective that waits longer fails (every process group)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    preset: str = "tiny"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The learning-rate shapes after warmup (trainer/schedule.py lr_at).
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
# What train.activation_checkpointing may recompute in backward (model/recompute.py; README "Activation checkpointing").
ACTIVATION_CHECKPOINTING = ("none", "full", "mlp")
DOCUMENT_MASKING_KERNELS = ("auto", "flex", "sdpa")  # train.document_masking_kernel (model/document_mask.py)
# String fields where the word "none" is one of the values; config_io reads it as null (refused) elsewhere.
NONE_IS_A_VALUE = ("train.activation_checkpointing",)


# Fields that no longer exist: a config that sets one is refused with the reason (configs stored in
# older checkpoints still load; config_io drops these keys there).
REMOVED_FIELDS = {
    "train.eval_batches": "renamed to train.eval_windows, the number of eval sequences (was eval_batches x micro_batch_size)",
}


# Upper bounds on values that pass every range check yet fail deep inside torch or datetime with a traceback.
MAX_LAYERS = 65536  # a typo guard: parameter counts and model building walk the layers one by one
INT64_MAX = 2**63 - 1  # torch and numpy take integers (seeds, sizes, divisors) as int64
MAX_THREADS = 4096  # torch.set_num_threads takes a C int; far more than any machine's cores is a typo
MAX_COLLECTIVE_TIMEOUT_S = 1e7  # about 116 days; datetime.timedelta overflows near 8.6e13 s
MIN_COLLECTIVE_TIMEOUT_S = 1e-3  # one millisecond, the unit process groups count their timeout in
# torch sizes a tensor's bytes in int64 ("Storage size calculation overflowed"): keep the widest
# weight (d_model against the vocabulary, the attention heads or all experts' hidden rows) far below.
MAX_WEIGHT_ELEMENTS = 2**48
FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38  # torch.finfo(torch.float32).max / .tiny


def _check(cond: bool, name: str, value: Any, expected: str) -> None:
    if not cond:
        raise ConfigError(f"{name}={value!r}: expected {expected}")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    _check(value in choices, name, value, f"one of {', '.join(choices)}")


def optional_inner(annotation: Any) -> Any | None:
    """T for a field declared `T | None` (or Optional[T]); None for any other annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None))
    return None


def _check_type(name: str, value: Any, annotation: Any) -> None:
    """The value has the field's declared type; floats are finite (inf steps or timeouts never end)."""
    inner = optional_inner(annotation)
    if inner is not None:
        if value is None:
            return
        annotation = inner
    if typing.get_origin(annotation) is list:
        _check(isinstance(value, list), name, value, "a list")
        for v in value:
            _check_type(f"{name}[]", v, typing.get_args(annotation)[0])
    elif annotation is bool:
        _check(isinstance(value, bool), name, value, "true or false")
    elif annotation is int:
        _check(isinstance(value, int) and not isinstance(value, bool), name, value, "an integer")
        _check(-INT64_MAX - 1 <= value <= INT64_MAX, name, value, "an integer in [-2**63, 2**63 - 1] (64 bits)")
    elif annotation is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), name, value,
               "a finite number")
    elif annotation is str:
        _check(isinstance(value, str), name, value, "a string")
    elif dataclasses.is_dataclass(annotation):  # a section given as a dict, None or another section
        _check(isinstance(value, annotation), name, value, f"a {annotation.__name__}")


def _check_types(obj: Any, prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        _check_type(f"{prefix}{f.name}", value, hints[f.name])
        if dataclasses.is_dataclass(value):
            _check_types(value, f"{prefix}{f.name}.")


# The model fields only an MoE layer reads (model/moe.py), besides num_experts itself and the router section.
EXPERT_ONLY_FIELDS = ("dense_layers", "expert_hidden", "shared_expert_hidden", "shared_expert_gate")


def _expert_fields_set(m: ModelConfig, baselines: tuple[ModelConfig, ...]) -> list[str]:
    """`model.expert_hidden=256`-style items for the expert-only and router fields of m whose value none of the
    baselines holds."""
    fields = [(f"model.{n}", getattr(m, n), [getattr(b, n) for b in baselines]) for n in EXPERT_ONLY_FIELDS]
    fields += [(f"model.router.{f.name}", getattr(m.router, f.name), [getattr(b.router, f.name) for b in baselines])
               for f in dataclasses.fields(RouterConfig)]
    return [f"{name}={value!r}" for name, value, usual in fields if value not in usual]


def warn_of_expert_settings_without_effect(m: ModelConfig, preset: ModelConfig) -> None:
    """A dense model (model.num_experts=0) given expert or router fields, or an MoE model whose dense_layers cover
    every layer (so it has no MoE layer), is warned about once: those fields change nothing. Not refused: a config
    written out whole (`moe-train info`, an import-hf config.json) holds every field, and one file may serve dense
    and MoE runs. For a dense model only values that are neither ModelConfig's default nor the preset's are named:
    an untouched config, or a preset made dense with --model.num_experts=0, says nothing. `stacklevel=3` points at
    build_config's caller."""
    if m.num_experts == 0:
        set_here = _expert_fields_set(m, (ModelConfig(), preset))
        if set_here:
            warnings.warn(f"{', '.join(set_here)}: no effect with model.num_experts=0, a dense model (every layer is "
                          f"a SwiGLU of model.dense_hidden={m.dense_hidden}; only MoE layers read the expert and "
                          "router fields); drop them, or set model.num_experts > 0 for an MoE model", stacklevel=3)
    elif not any(m.is_moe_layer(i) for i in range(m.num_layers)):
        warnings.warn(f"model.dense_layers={m.dense_layers} lists every layer (model.num_layers={m.num_layers}), so "
                      f"the model has no MoE layer: model.num_experts={m.num_experts}, model.expert_hidden, "
                      "model.shared_expert_hidden, model.shared_expert_gate and model.router.* have no effect; "
                      "leave a layer out of model.dense_layers, or set model.num_experts=0 for a dense model",
                      stacklevel=3)


def validate_model(m: ModelConfig) -> ModelConfig:
    """The model section checked as a run's is, for a module built from a ModelConfig directly (not through
    build_config or the Trainer): a bad field otherwise ran silently or failed deep inside a forward."""
    validate(Config(model=m))
    return m


def validate(cfg: Config) -> Config:
    """Raise ConfigError on the first invalid field; return cfg unchanged when valid."""
    _check_types(cfg)
    m, r, d, t, p = cfg.model, cfg.model.router, cfg.data, cfg.train, cfg.parallel
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "dense_hidden"):
        _check(getattr(m, name) > 0, f"model.{name}", getattr(m, name), "a positive integer")
    _check(m.num_layers <= MAX_LAYERS, "model.num_layers", m.num_layers, f"<= {MAX_LAYERS}")
    _check(m.head_dim is None or m.head_dim > 0, "model.head_dim", m.head_dim,
           "a positive integer (or null for model.d_model // model.num_heads)")
    for name in ("rope_theta", "norm_eps", "init_std"):
        _check(getattr(m, name) > 0, f"model.{name}", getattr(m, name), "a positive number")
    _check(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads", m.num_kv_heads,
           f"a divisor of model.num_heads={m.num_heads}")
    if m.head_dim is None:
        _check(m.d_model % m.num_heads == 0, "model.num_heads", m.num_heads,
               f"a divisor of model.d_model={m.d_model} (or set model.head_dim)")
    _check(0 < m.rotary_fraction <= 1, "model.rotary_fraction", m.rotary_fraction,
           "in (0, 1] (the fraction of each head's dims RoPE rotates)")
    if m.rotary_fraction == 1:
        # a null head_dim is named with the two fields it comes from: the user set those, not it
        derived = ("" if m.head_dim is not None
                   else f"; null: model.d_model={m.d_model} // model.num_heads={m.num_heads}")
        _check(m.resolved_head_dim % 2 == 0, "model.head_dim", m.resolved_head_dim,
               f"an even number (RoPE rotates pairs{derived})")
    rotary = m.rotary_fraction * m.resolved_head_dim
    # 0.14 x 100 is 14.000000000000002 and 0.58 x 100 is 57.99999999999999 in floating point (the export's rotary dims
    # are int() of the product, as transformers' are): say so, not "gives 14" for a 14 refused
    nearest = round(rotary)
    rounded_off = rotary != nearest and nearest % 2 == 0 and abs(rotary - nearest) < 1e-9 * m.resolved_head_dim
    gives = (f"{rotary!r} in floating point, not exactly {nearest}: use a fraction a float holds exactly (k / 2**n) "
             "or another head_dim") if rounded_off else f"{rotary:g}"
    _check(rotary == int(rotary) and int(rotary) % 2 == 0, "model.rotary_fraction", m.rotary_fraction,
           f"a fraction of head_dim={m.resolved_head_dim} that rotates a whole even number of dims (RoPE rotates "
           f"pairs; this one gives {gives})")
    _check(m.num_experts >= 0, "model.num_experts", m.num_experts, "0 (dense) or a positive integer")
    for w in m.sliding_window_pattern:
        _check(isinstance(w, int) and not isinstance(w, bool) and w >= 0, "model.sliding_window_pattern",
               m.sliding_window_pattern, "a list of integers >= 0 (a layer's window in tokens, itself included; "
               "0 = full causal attention)")
    for i in m.dense_layers:
        _check(0 <= i < m.num_layers, "model.dense_layers", m.dense_layers, f"indices in [0, {m.num_layers})")
    if m.num_experts > 0:
        _check(m.expert_hidden > 0, "model.expert_hidden", m.expert_hidden, "a positive integer")
        _check(1 <= r.top_k <= m.num_experts, "model.router.top_k", r.top_k,
               f"1 <= top_k <= model.num_experts={m.num_experts}")
    _check(m.shared_expert_hidden >= 0, "model.shared_expert_hidden", m.shared_expert_hidden, ">= 0")
    _check(not m.shared_expert_gate or m.shared_expert_hidden > 0, "model.shared_expert_gate", m.shared_expert_gate,
           f"false with model.shared_expert_hidden={m.shared_expert_hidden} (the gate scales the shared expert's "
           "output: set model.shared_expert_hidden > 0, or leave the gate off)")
    widths = {"model.vocab_size": m.vocab_size, "model.num_heads x head_dim": m.num_heads * m.resolved_head_dim,
              "model.dense_hidden": m.dense_hidden, "model.shared_expert_hidden": m.shared_expert_hidden,
              "model.num_experts x expert_hidden": m.num_experts * m.expert_hidden}
    widest = max(widths, key=widths.__getitem__)
    _check(m.d_model * widths[widest] <= MAX_WEIGHT_ELEMENTS, widest, widths[widest],
           f"model.d_model={m.d_model} times it <= 2**48 elements in one weight "
           "(torch sizes a tensor's bytes in int64)")
    _choice("model.router.gating", r.gating, ("softmax", "sigmoid"))
    _choice("model.router.routing", r.routing, ("learned", "random", "uniform"))
    _choice("model.router.lb_loss_scope", r.lb_loss_scope, ("micro_batch", "global"))
    for name in ("lb_loss_weight", "z_loss_weight", "expert_bias_rate"):
        _check(getattr(r, name) >= 0, f"model.router.{name}", getattr(r, name), ">= 0")
    _check(r.routed_scaling_factor > 0, "model.router.routed_scaling_factor", r.routed_scaling_factor,
           "a finite number > 0 (1.0 leaves the routing weights as they are)")
    _choice("model.gemm_backend", m.gemm_backend, ("auto", "torch", "reference", "triton"))
    _choice("model.precision", m.precision, ("bf16",))
    for name, path in (("data.path", d.path), ("data.cache_dir", d.cache_dir), ("train.run_dir", t.run_dir)):
        _check(path != "", name, path, "a non-empty path")
    _check(t.init_from != "", "train.init_from", t.init_from, "a checkpoint's path, or null for a random init")
    _check(d.seq_len >= 2, "data.seq_len", d.seq_len, ">= 2")
    _check(d.seed >= 0, "data.seed", d.seed, "an integer >= 0")
    for name in ("default_vocab_size", "default_max_bytes"):
        _check(getattr(d, name) > 0, f"data.{name}", getattr(d, name), "a positive integer")
    _check(0 < d.eval_fraction < 1, "data.eval_fraction", d.eval_fraction, "in (0, 1)")
    # prepare-data holds out blocks in millionths (prepare.eval_blocks): a share that rounds to none or to all of them
    _check(0 < Fraction(d.eval_fraction).limit_denominator(10**6) < 1, "data.eval_fraction", d.eval_fraction,
           "between 1e-06 and 1 - 1e-06, the share of blocks held out for eval (counted in millionths)")
    for name in ("steps", "micro_batch_size", "grad_accum", "eval_windows", "log_interval", "keep_last",
                 "max_skipped_steps"):
        _check(getattr(t, name) >= 1, f"train.{name}", getattr(t, name), "a positive integer")
    # AdamW runs in float32: an lr past its largest value is inf, an eps below its smallest normal underflows (to 0
    # where subnormals are flushed: 0 / 0 = NaN for a weight whose gradient is 0); either makes the weights NaN.
    _check(t.lr > 0, "train.lr", t.lr, "> 0")
    _check(t.lr <= FLOAT32_MAX, "train.lr", t.lr, f"<= {FLOAT32_MAX:.4g} (float32's largest; AdamW runs in float32)")
    _check(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", t.min_lr_ratio, "in [0, 1]")
    _check(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, ">= 0")
    _choice("train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    _check(0 < t.lr_decay_fraction <= 1, "train.lr_decay_fraction", t.lr_decay_fraction, "in (0, 1]")
    default_fraction = TrainConfig.__dataclass_fields__["lr_decay_fraction"].default
    _check(t.lr_schedule == "wsd" or t.lr_decay_fraction == default_fraction, "train.lr_decay_fraction",
           t.lr_decay_fraction, f"{default_fraction} (its default) with train.lr_schedule={t.lr_schedule}: only wsd "
           "reads it; set train.lr_schedule=wsd or leave lr_decay_fraction out")
    for name in ("eval_interval", "save_interval"):
        _check(getattr(t, name) >= 0, f"train.{name}", getattr(t, name), ">= 0 (0 disables)")
    _check(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, ">= 0 (0 disables)")
    _check(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, ">= 0")
    for name in ("beta1", "beta2"):
        _check(0 <= getattr(t, name) < 1, f"train.{name}", getattr(t, name), "in [0, 1)")
    _check(t.eps > 0, "train.eps", t.eps, "> 0")
    _check(t.eps >= FLOAT32_TINY, "train.eps", t.eps,
           f">= {FLOAT32_TINY:.4g} (float32's smallest normal number; AdamW runs in float32, where a smaller eps "
           "underflows)")
    _check(t.seed >= 0, "train.seed", t.seed, "an integer >= 0")
    _check(0 <= t.threads <= MAX_THREADS, "train.threads", t.threads,
           f">= 0 and <= {MAX_THREADS} (0 leaves torch's default)")
    _choice("train.device", t.device, ("auto", "cpu", "cuda"))
    _choice("train.activation_checkpointing", t.activation_checkpointing, ACTIVATION_CHECKPOINTING)
    _choice("train.document_masking_kernel", t.document_masking_kernel, DOCUMENT_MASKING_KERNELS)
    _check(t.loss_chunk_tokens >= 0, "train.loss_chunk_tokens", t.loss_chunk_tokens,
           "an integer >= 0 (tokens per chunk of the LM head and loss; 0 = no chunks)")
    _check(t.lm_z_loss_weight >= 0, "train.lm_z_loss_weight", t.lm_z_loss_weight, ">= 0 (0 = no LM head z-loss)")
    for name in ("dp", "ep", "pp"):
        _check(getattr(p, name) >= 1, f"parallel.{name}", getattr(p, name), "a positive integer")
    _choice("parallel.backend", p.backend, ("auto", "gloo", "nccl"))
    # process groups take the timeout in whole milliseconds: below one it is 0, and gloo's first all-to-all then
    # fails an internal check (`timeout_2.count() > 0`) with a traceback after the run has started
    _check(MIN_COLLECTIVE_TIMEOUT_S <= p.collective_timeout_s <= MAX_COLLECTIVE_TIMEOUT_S,
           "parallel.collective_timeout_s", p.collective_timeout_s,
           "a positive number of seconds <= 1e7 (about 116 days) and >= 0.001 (process groups count whole "
           "milliseconds: less is a timeout of 0)")
    _choice("parallel.strategy", p.strategy, ("ddp", "fsdp"))
    _choice("parallel.param_dtype", p.param_dtype, ("fp32", "bf16"))
    if p.strategy == "fsdp":
        _check(not t.compile, "train.compile", t.compile,
               "false with parallel.strategy='fsdp' (the FSDP2 baseline runs eager; compile runs with 'ddp')")
        _check(t.save_interval == 0, "train.save_interval", t.save_interval,
               "0 with parallel.strategy='fsdp' (the FSDP2 baseline writes no checkpoints)")
        _check(p.ep == 1, "parallel.ep", p.ep, "1 with parallel.strategy='fsdp' (the dense-sharding baseline)")
        _check(t.init_from is None, "train.init_from", t.init_from,
               "null with parallel.strategy='fsdp' (the FSDP2 baseline loads no checkpoints; train.init_from runs with "
               "'ddp')")
        _check(p.param_dtype == "fp32", "parallel.param_dtype", p.param_dtype,
               "'fp32' with parallel.strategy='fsdp' (the FSDP2 baseline keeps no fp32 masters: its torch AdamW "
               "would update the bf16 weights and moments; bf16 resident weights run with 'ddp')")
    _check(p.pp == 1, "parallel.pp", p.pp, "1 (pipeline parallelism is not built yet)")
    if p.ep > 1:
        _check(m.num_experts > 0, "parallel.ep", p.ep, "1: model.num_experts=0 is a dense model, no experts to spread")
        _check(m.num_experts == 0 or any(m.is_moe_layer(i) for i in range(m.num_layers)), "parallel.ep", p.ep,
               f"1: model.dense_layers={m.dense_layers} makes every one of the {m.num_layers} layers dense, no experts "
               "to spread")
        _check(m.num_experts % p.ep == 0, "parallel.ep", p.ep, f"a divisor of model.num_experts={m.num_experts}")
        _check(p.dp % p.ep == 0, "parallel.ep", p.ep, f"a divisor of parallel.dp={p.dp} (experts fold over data parallelism)")
    _check(p.expert_capacity_factor == 0 or p.expert_capacity_factor >= 1, "parallel.expert_capacity_factor",
           p.expert_capacity_factor, "0 (dropless) or >= 1")
    return cfg
