"""Activations: a symbolic replay of one decoder layer's forward, op by op.

`Walk` records which tensors autograd keeps for backward, by storage (a tensor saved by two
ops, or a view of a saved tensor, is counted once), and only when the gradient that needs it
is required -- exactly as PyTorch's generated backward formulas decide. Facts this captures
that a "bytes per token" constant would miss, all measured on torch 2.13 / transformers 5 /
peft 0.21 (tests/unit/memory/test_memory.py checks them against `saved_tensors_hooks`):

* Frozen base linears save nothing but their weight; the LoRA A matmul saves the input.
* PEFT would cast every LoRA input to fp32 under autocast (and autocast back), giving each
  adapted module its *own* bf16 copy of its input to keep; `jobs.model.loading` turns that off, so
  the adapters of q, k and v (gate and up) keep one shared tensor, counted once.
* RMSNorm keeps an fp32 copy of its input; without checkpointing the first layer's input
  norm saves nothing (the embeddings are frozen); HF checkpointing turns input grads on.
* SDPA keeps q, k, v, out and the log-sum-exp, no seq x seq matrix. Padded batches carry no
  mask (`jobs.data.collate`: right padding + causal attention is exact), so they cost what
  full ones do. A mask -- packed rows' block-diagonal float bias (one tensor shared by every
  layer), or HF's sliding-window bool mask (converted to a float bias that each layer saves)
  -- disables SDPA's native GQA: k, v are repeated to all heads. Eager keeps the fp32
  softmax and its compute-dtype copy. FlexAttention keeps what SDPA keeps; packed rows carry a
  `BlockMask` of a few KiB (not counted) instead of the bias, and GQA stays native unless the
  number of query heads is not a power of 2 (transformers then repeats k, v). Modelled, not
  measured: FlexAttention has no backward on CPU.
* Compiled decoder layers (`compiled`, `model.compile`; Llama-family layers): inductor's
  partitioner keeps RMSNorm's input in the compute dtype with its fp32 rsqrt (not the fp32
  copy), recomputes SiLU(gate) in backward instead of keeping it, as measured with `saved_tensors_hooks`, which see
  compiled graphs' saved tensors too (tests/unit/memory/test_memory.py::test_compiled_layers_*). The final
  norm runs outside the compiled layers, eagerly.

Pure: sizes only, no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobs.memory.shapes import FP32_BYTES, INDEX_BYTES, ModelShape, round_up


@dataclass
class ReplayTensor:
    """A tensor in the replay: its storage id, bytes and whether it requires grad."""

    sid: int
    nbytes: int
    rg: bool


class Walk:
    """Replays the ops of a decoder layer and collects what autograd saves, by storage."""

    def __init__(
        self,
        shape: ModelShape,
        *,
        batch: int,
        seq: int,
        act_bytes: int,
        autocast: bool,
        targets: set[str],
        r: int,
        lora_dropout: float,
        attn: str,
        mask: bool,
        device: str,
        packed: bool = False,
        dora: bool = False,
        compiled: bool = False,
    ):
        self.s, self.B, self.S, self.N = shape, batch, seq, batch * seq
        self.dora = dora
        # Compiled layers are modelled for the Llama family; other families replay eagerly (more).
        self.compiled = compiled and shape.family == "llama"
        self.a, self.autocast = act_bytes, autocast
        self.targets, self.r, self.p = targets, r, lora_dropout
        self.attn, self.mask, self.device = attn, mask, device
        self.saved: dict[int, int] = {}
        self._next = 0
        # Shared by every layer: RoPE cos/sin ([1, S, head_dim] each, in the embeddings' dtype;
        # [B, S, head_dim] for packed rows, whose position ids differ per row).
        rows = batch if packed else 1
        self.cos = self.new(rows * seq * (shape.rotary_dims or shape.head_dim) * act_bytes, False)
        self.sin = self.new(self.cos.nbytes, False)
        self.position_ids = self.new(rows * seq * INDEX_BYTES, False)
        # Packed rows: `jobs.objectives.sft.packed_attention_mask`, one [B, 1, S, S] float bias in the
        # compute dtype that every layer's attention uses (and SDPA saves) as is.
        # FlexAttention's `BlockMask` instead (`jobs.objectives.sft.packed_block_mask`): a few KiB, not counted.
        self.packed = packed
        self.bias = self.new(batch * seq * seq * act_bytes, False) if packed and attn != "flex_attention" else None

    def new(self, nbytes: int, rg: bool) -> ReplayTensor:
        self._next += 1
        return ReplayTensor(self._next, int(nbytes), rg)

    def save(self, *ts: ReplayTensor) -> None:
        for t in ts:
            self.saved[t.sid] = t.nbytes

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    # -- building blocks --
    def rms_norm(self, x: ReplayTensor, compiled: bool = False) -> ReplayTensor:
        """`x.float()`, pow, mean, rsqrt, mul; `weight * y.to(dtype)` with a frozen weight.
        Compiled, the fp32 copy is fused away: the input itself is kept (with the rsqrt)."""
        x32 = x if self.a == FP32_BYTES or compiled else self.new(self.N * self.s.hidden * FP32_BYTES, x.rg)
        if x.rg:
            self.save(x32, self.new(self.N * FP32_BYTES, True))  # the (fp32) input and rsqrt(var + eps)
        return self.new(self.N * self.s.hidden * self.a, x.rg)

    def layer_norm(self, x: ReplayTensor) -> ReplayTensor:
        """native_layer_norm saves its input, mean and rstd (the frozen weight is a parameter).

        CUDA autocast runs layer_norm in fp32: an fp32 copy of the input (and of the weight)
        is what gets saved, and the output is fp32. CPU autocast leaves it in the compute dtype.
        """
        n, h = self.N, self.s.hidden
        if self.autocast and self.device == "cuda":
            if x.rg:
                self.save(
                    self.new(n * h * FP32_BYTES, True),
                    self.new(n * FP32_BYTES, True),
                    self.new(n * FP32_BYTES, True),
                    self.new(h * FP32_BYTES, False),
                )
            return self.new(n * h * FP32_BYTES, x.rg)
        if x.rg:
            self.save(x, self.new(n * self.a, True), self.new(n * self.a, True))
        return self.new(n * h * self.a, x.rg)

    def linear(self, x: ReplayTensor, name: str) -> ReplayTensor:
        """Frozen base linear (+ LoRA when targeted). The base saves only its weight."""
        fan_in, fan_out = self.s.linear_shapes()[name]
        out = self.new(self.N * fan_out * self.a, x.rg or name in self.targets)
        if name not in self.targets:
            return out
        n, r, a = self.N, self.r, self.a
        # The adapters read their input in the compute dtype (`jobs.model.loading` keeps PEFT from
        # casting it to fp32 under autocast), so lora_A keeps the very tensor the base linear
        # got: q, k and v (gate and up) share it.
        lora_in = x
        if self.p > 0:
            # Dropout on the LoRA input: CUDA's fused kernel keeps a bool mask, the CPU kernel
            # (input * bernoulli noise) keeps the noise in the input's dtype.
            if x.rg:
                self.save(self.new(n * fan_in if self.device == "cuda" else x.nbytes, True))
            lora_in = self.new(x.nbytes, x.rg)
        # An fp32 input under autocast (CUDA layer_norm's output) is cast for the matmul, and
        # lora_A keeps that copy.
        if self.autocast and lora_in.nbytes != n * fan_in * a:
            lora_in = self.new(n * fan_in * a, x.rg)
        self.save(lora_in)
        if self.autocast:
            if x.rg:
                self.save(self.new(r * fan_in * a, False))  # autocast copy of A (for the input gradient)
            self.save(self.new(fan_out * r * a, False))  # autocast copy of B
        self.save(self.new(n * r * a, True))  # lora_B saves lora_A's output (for B's gradient)
        if self.dora:
            self.dora_terms(x, fan_out)
        return out

    def dora_terms(self, x: ReplayTensor, fan_out: int) -> None:
        """What PEFT's DoRA (`DoraLinearLayer.forward`) keeps beyond LoRA, per adapted linear.
        `(s - 1) * base_result` keeps the base linear's output (a storage of its own: the layer
        returns `base_result + dora_result`, a new tensor) and, when that output requires grad
        (the layer input does), the fp32 `s - 1`; `s * lora_result` keeps B(A(x)) in the compute
        dtype and the fp32 `s = m / ||W + BA||_c`; the division keeps the detached norm (in the
        activation dtype). The eye-matrix pass that builds BA for the norm is freed before
        forward ends (a per-layer transient of in x in, not counted)."""
        n, a = self.N, self.a
        self.save(
            self.new(n * fan_out * a, x.rg),  # base_result
            self.new(n * fan_out * a, True),  # lora_result
            self.new(fan_out * a, False),  # the detached weight norm
            self.new(fan_out * FP32_BYTES, True),
        )  # s
        if x.rg:
            self.save(self.new(fan_out * FP32_BYTES, True))  # s - 1

    def attention(self, q: ReplayTensor, k: ReplayTensor, v: ReplayTensor) -> ReplayTensor:
        s, B, S, N, a = self.s, self.B, self.S, self.N, self.a
        if q.rg or k.rg:
            self.save(self.cos, self.sin)  # RoPE's muls keep cos and sin, not q and k
        q = self.new(N * s.q_dim * a, q.rg)
        k = self.new(N * s.kv_dim * a, k.rg)
        any_rg = q.rg or k.rg or v.rg
        rep = s.heads // s.kv_heads
        # transformers' FlexAttention keeps GQA native only for a power-of-2 number of query heads.
        flex_repeats = self.attn == "flex_attention" and s.heads & (s.heads - 1) != 0
        if self.attn == "eager" or self.mask or flex_repeats:
            # HF repeats k/v to all heads unless SDPA can do GQA natively (no mask). With one
            # kv head (MQA) the expand + reshape stays a view; otherwise it is a copy.
            if rep > 1 and s.kv_heads > 1:
                k = self.new(N * s.q_dim * a, k.rg)
                v = self.new(N * s.q_dim * a, v.rg)
        if self.attn in ("sdpa", "flex_attention"):  # both keep q, k, v, out and the log-sum-exp
            out = self.new(N * s.q_dim * a, any_rg)
            if any_rg:
                self.save(q, k, v, out, self.new(B * s.heads * S * FP32_BYTES, True))  # + log-sum-exp
                if self.bias is not None:  # packed rows
                    self.save(self.bias)  # the shared bias: one storage however many layers save it
                elif self.mask:
                    # Bool mask -> float bias (one per call), padded to 16 columns for CUDA mem-efficient.
                    cols = round_up(S, 16) if self.device == "cuda" else S
                    self.save(self.new(B * S * cols * a, False))
            # CUDA kernels write the output as [B, S, heads, D], so HF's transpose(1, 2).contiguous()
            # is free; the CPU kernel follows q's layout, which GPT-NeoX's rotary cat made [B, heads, S, D].
            if self.device != "cuda" and s.family == "gpt_neox":
                return self.new(out.nbytes, out.rg)
            return out
        # eager: matmul(q, k^T) * scale + mask -> softmax(fp32) -> .to(dtype) -> dropout -> matmul(., v)
        scores = B * s.heads * S * S
        if k.rg:
            self.save(q)
        if q.rg:
            self.save(k)
        probs32 = self.new(scores * FP32_BYTES, any_rg)
        if any_rg:
            self.save(probs32)
        probs = probs32 if a == FP32_BYTES else self.new(scores * a, any_rg)
        if s.attention_dropout > 0 and any_rg:
            self.save(self.new(scores * (1 if self.device == "cuda" else a), False))
            probs = self.new(scores * a, True)
        if v.rg:
            self.save(probs)
        if probs.rg:
            self.save(v)
        return self.new(N * s.q_dim * a, any_rg)  # transpose(1, 2).contiguous(): a new tensor

    def gated_mlp(self, x: ReplayTensor) -> ReplayTensor:
        gate, up = self.linear(x, "gate_proj"), self.linear(x, "up_proj")
        if gate.rg:
            self.save(gate)  # silu saves its input
        act = self.new(gate.nbytes, gate.rg)
        if up.rg and not self.compiled:  # compiled: silu(gate) is recomputed from gate in backward
            self.save(act)
        if act.rg:
            self.save(up)
        return self.linear(self.new(act.nbytes, act.rg or up.rg), "down_proj")

    # -- one decoder layer --
    def llama_layer(self, x: ReplayTensor) -> ReplayTensor:
        h = self.rms_norm(x, self.compiled)
        q, k, v = self.linear(h, "q_proj"), self.linear(h, "k_proj"), self.linear(h, "v_proj")
        o = self.linear(self.attention(q, k, v), "o_proj")
        x = self.new(x.nbytes, x.rg or o.rg)  # residual add saves nothing
        m = self.gated_mlp(self.rms_norm(x, self.compiled))
        return self.new(x.nbytes, x.rg or m.rg)

    def gpt_neox_layer(self, x: ReplayTensor) -> ReplayTensor:
        s = self.s
        qkv = self.linear(self.layer_norm(x), "query_key_value")
        # q, k, v are views of the fused output (saving v keeps all of it); RoPE makes new q, k.
        q = k = v = qkv
        attn_out = self.linear(self.attention(q, k, v), "dense")
        mlp_in = x if s.parallel_residual else self.new(x.nbytes, x.rg or attn_out.rg)
        fc = self.linear(self.layer_norm(mlp_in), "dense_h_to_4h")
        if fc.rg:
            self.save(fc)  # gelu saves its input
        mlp = self.linear(self.new(fc.nbytes, fc.rg), "dense_4h_to_h")
        return self.new(x.nbytes, x.rg or attn_out.rg or mlp.rg)

    def layer(self, x: ReplayTensor) -> ReplayTensor:
        return self.gpt_neox_layer(x) if self.s.family == "gpt_neox" else self.llama_layer(x)

    def final_norm(self, x: ReplayTensor) -> ReplayTensor:
        return self.layer_norm(x) if self.s.family == "gpt_neox" else self.rms_norm(x)
