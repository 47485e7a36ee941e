"""The op graph of a Hugging Face Llama-family model, with autograd's saving rules.

This is where the activation memory is *derived*. ``ModelGraph`` writes down the ops a
``LlamaForCausalLM`` (also Qwen2, Mistral) runs in forward -- as in transformers'
``modeling_llama.py`` with the SDPA attention -- and for each op the tensors autograd
saves, under the rule autograd's generated code follows: an input needed only for the
gradient of another input is saved only if that other input requires a gradient.
Per decoder layer (N tokens, hidden h, intermediate i, dtype size s) that gives:

* RMSNorm ``w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)``: ``x.float()``
  (4h bytes/token, saved by pow and mul when x needs a gradient; the same tensor as x
  when the model is fp32), ``rsqrt`` (4 bytes), and the normalised ``.to(dtype)`` (s*h)
  only when the norm weight is trained (mul saves the *other* operand);
* each linear saves its input only when its weight is trained (q/k/v share one input);
  a LoRA adapter saves its input cast to the adapter dtype (peft keeps adapters in fp32)
  and the rank-r intermediate;
* RoPE saves only cos/sin (shared by every layer, so they stay until the first layer's backward);
* SDPA (flash/cuDNN kernels, and the CPU flash kernel) saves q, k, v, the output (the
  same storage o_proj reads) and the fp32 log-sum-exp (4 bytes per head per token);
* the SwiGLU MLP saves gate (for silu), silu(gate) and up (for the product), and the
  product (down_proj's input, when down_proj is trained);
* a projection's argument lives until the projection returns, even where nothing saves it
  (the caller's frame holds it: in bf16 the MLP product beside peft's fp32 copy of it).

The loss path follows transformers' ``ForCausalLMLoss``: logits in the model dtype, an
fp32 copy (``logits.float()``, free when the model is fp32), ``log_softmax`` saves its
fp32 output, and backward creates fp32 gradients of the same size.

``simulate.py`` replays these ops to get the live bytes at every moment.
"""
from __future__ import annotations

from dataclasses import dataclass

from memfit.ledger.simulate import Op, Sym
from memfit.models.spec import ModelSpec, dtype_bytes

FP32 = "float32"


@dataclass(frozen=True)
class Trainable:
    """Which parameters need gradients, and the LoRA adapters attached."""

    linears: bool = True  # base linear weights (and biases)
    norms: bool = True
    embeddings: bool = True  # embedding and (untied) lm_head
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    lora_dtype: str = FP32  # peft keeps adapter weights in fp32 by default


def sdpa_fused_kernel(spec: ModelSpec, dtype: str, device: str) -> bool:
    """Whether torch SDPA has a fused kernel (no score tensor) for this model's heads: off CUDA always (the CPU's
    flash kernel); on CUDA flash attention for 16-bit dtypes with heads of up to 256 dimensions, or the
    memory-efficient kernel where there are no grouped KV heads (it takes no ``enable_gqa``). Where neither, CUDA
    runs the math kernel. (``memfit.infer.generate.mask_free_causal_kernel`` asks torch the same at run time.)"""
    flash = dtype_bytes(dtype) == 2 and spec.head_dim <= 256
    return device != "cuda" or flash or spec.num_heads == spec.num_kv_heads


class ModelGraph:
    """Builds the ops of one forward pass of ``spec`` over ``batch`` x ``seq`` tokens."""

    def __init__(self, spec: ModelSpec, batch: int, seq: int, dtype: str, trainable: Trainable | None,
                 device: str = "cuda", four_bit: bool = False, attention: str = "sdpa",
                 ffn_widths: list[int] | None = None, structured: dict[str, tuple] | None = None,
                 fused_swiglu: bool = False):
        self.spec, self.batch, self.seq, self.dtype = spec, batch, seq, dtype
        self.biased = spec.biased_projections()
        # FFN neurons per layer (partial loading keeps fewer in the middle layers)
        self.ffn_widths = ffn_widths or [spec.intermediate] * spec.num_layers
        # block-low-rank projections: kind -> (parameters per layer, {bias: transients per token}, whether its
        # input's gradient is a view) (predict.structured_kinds)
        self.structured = structured or {}
        self.attention_impl = attention
        self.four_bit = four_bit  # frozen base linears stored in NF4, dequantised per use
        self.fused_swiglu = fused_swiglu  # the gated MLP's product by memfit.kernels.swiglu
        self.tokens = batch * seq
        self.trainable = trainable  # None: inference, nothing needs a gradient
        self.device = device
        self.ops: list[Op] = []
        self.params: list[Sym] = []
        self.segment: int | None = None

    # ---- tensors ---------------------------------------------------------------------
    def _bytes(self, per_token: int, dtype: str, tokens: int | None = None) -> int:
        return (self.tokens if tokens is None else tokens) * per_token * dtype_bytes(dtype)

    def param(self, name: str, numel: int, trainable: bool, dtype: str | None = None) -> Sym:
        size = dtype_bytes(dtype or self.dtype)
        sym = Sym(name, numel * size, trainable, "weights", persistent=True, element_size=size)
        self.params.append(sym)
        return sym

    def act(self, name: str, per_token: int, requires_grad: bool, dtype: str | None = None,
            component: str = "temporaries", tokens: int | None = None) -> Sym:
        return Sym(name, self._bytes(per_token, dtype or self.dtype, tokens), requires_grad, component)

    def release(self, sym: Sym) -> None:
        """``sym`` is a local variable of a Python frame that ends here: alive until the last op so far."""
        self.ops[-1].holds.append(sym)

    def op(self, name: str, inputs: list[Sym], outputs: list[Sym], saves: list[Sym], **workspace) -> None:
        self.ops.append(Op(name, inputs, outputs, [s for s in saves if s is not None], segment=self.segment,
                           **workspace))

    # ---- autograd rules of the ops the model uses --------------------------------------
    def cast(self, x: Sym, dtype: str, per_token: int, name: str) -> Sym:
        """``x.to(dtype)``: a new tensor unless the dtype is already ``dtype``; saves nothing."""
        if x.nbytes == self._bytes(per_token, dtype):
            return x
        out = self.act(name, per_token, x.requires_grad, dtype, x.component)
        self.op(name, [x], [out], [])
        return out

    def linear(self, x: Sym, weight: Sym, per_token_out: int, name: str, dtype: str | None = None,
               bias: Sym | None = None, tokens: int | None = None, input_grad_is_view: bool = True,
               **workspace) -> Sym:
        """``F.linear``: saves the input iff the weight is trained (the weight is a parameter: free). The gradient
        of its 3-D input (every linear here gets one) is a view, the reshape of a matrix product's, which autograd
        cannot add a second gradient into."""
        rg = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        out = self.act(name, per_token_out, rg, dtype, tokens=tokens)
        inputs = [x, weight] + ([bias] if bias is not None else [])
        self.op(name, inputs, [out], [x] if weight.requires_grad else [], input_grads_are_views=input_grad_is_view,
                **workspace)
        return out

    def mul(self, a: Sym, b: Sym, per_token: int, name: str, dtype: str | None = None) -> Sym:
        """``a * b``: keeps b for a's gradient and a for b's gradient."""
        out = self.act(name, per_token, a.requires_grad or b.requires_grad, dtype)
        saves = ([b] if a.requires_grad else []) + ([a] if b.requires_grad else [])
        self.op(name, [a, b], [out], saves)
        return out

    def swiglu(self, gate: Sym, up: Sym, per_token: int, name: str) -> Sym:
        """memfit.kernels.swiglu: ``silu(gate) * up`` in one pass, keeping gate and up and writing their gradients
        over them (its Triton path; off Triton the reference's backward adds two transient temporaries of gate's
        size, not counted)."""
        rg = gate.requires_grad or up.requires_grad
        out = self.act(name, per_token, rg)
        self.op(name, [gate, up], [out], [gate, up] if rg else [], grads_over_saved=True)
        return out

    def pointwise(self, inputs: list[Sym], per_token: int, name: str, saves_input: bool = False,
                  saves_output: bool = False, dtype: str | None = None, **workspace) -> Sym:
        rg = any(s.requires_grad for s in inputs)
        out = self.act(name, per_token, rg, dtype)
        saves = (inputs[:1] if saves_input and rg else []) + ([out] if saves_output and rg else [])
        self.op(name, inputs, [out], saves, **workspace)
        return out

    def add(self, a: Sym, b: Sym, per_token: int, name: str, dtype: str | None = None) -> Sym:
        """``a + b``: a new tensor; its backward hands the output's gradient itself to each input of the output's
        size (torch's AddBackward returns ``grad`` as it is), so no input gradient is a buffer of its own."""
        return self.pointwise([a, b], per_token, name, dtype=dtype, input_grads_are_output_grad=True)

    # ---- model pieces ------------------------------------------------------------------
    def rms_norm(self, x: Sym, weight: Sym, name: str) -> Sym:
        h = self.spec.hidden
        x32 = self.cast(x, FP32, h, f"{name}.float")
        # pow's backward, grad * (2 * x.pow(1)), holds two temporaries of x's size besides the new gradient (the
        # replay's second gradient of x, added in place to the one the scale's backward, first in backward, gave)
        square = self.pointwise([x32], h, f"{name}.pow", saves_input=True, dtype=FP32,
                                backward_workspace=2 * x32.nbytes)
        variance = self.pointwise([square], 1, f"{name}.mean", dtype=FP32)
        shifted = self.pointwise([variance], 1, f"{name}.add_eps", dtype=FP32)
        inv = self.pointwise([shifted], 1, f"{name}.rsqrt", saves_output=True, dtype=FP32)
        normed = self.mul(x32, inv, h, f"{name}.scale", dtype=FP32)
        normed = self.cast(normed, self.dtype, h, f"{name}.to_dtype")
        return self.mul(weight, normed, h, f"{name}.weight")

    def projection(self, x: Sym, layer: int, module: str, per_token_in: int, per_token_out: int) -> Sym:
        """A linear layer, with a bias where the model has one (ModelSpec.biased_projections) and an optional LoRA
        adapter (peft's Linear.forward)."""
        t = self.trainable
        bias = module in self.biased
        trained = bool(t and t.linears)
        if module in self.structured:
            # BlastLinear/MonarchLinear/LowRankLinear: their ops save only the input (backward recomputes
            # the intermediates, which forward and backward hold transiently: predict.blr_transient_per_token).
            params, transients, grad_is_view = self.structured[module]
            forward, backward = transients[bias]
            weight = self.param(f"{layer}.{module}", params, trained)
            workspace = {"forward_workspace": self._bytes(forward, self.dtype),
                         "backward_workspace": self._bytes(backward, self.dtype), "input_grad_is_view": grad_is_view}
        elif self.four_bit and not trained:
            # bitsandbytes NF4: 4-bit codes plus double-quantised absmax; matmul_4bit dequantises the
            # whole weight to the compute dtype in forward and again in backward (for the input grad).
            from memfit.train.four_bit import nf4_bytes

            weight = Sym(f"{layer}.{module}", nf4_bytes(per_token_in, per_token_out), False, "weights",
                         persistent=True, element_size=1)
            self.params.append(weight)
            # Its MatMul4Bit takes the 3-D input whole: the input's gradient is a product of its own, no view.
            dequant = per_token_in * per_token_out * dtype_bytes(self.dtype)
            workspace = {"forward_workspace": dequant, "backward_workspace": dequant, "input_grad_is_view": False}
        else:
            weight = self.param(f"{layer}.{module}", per_token_in * per_token_out, trained)
            workspace = {}
        bias_sym = self.param(f"{layer}.{module}.bias", per_token_out, trained) if bias else None
        out = self.linear(x, weight, per_token_out, f"{layer}.{module}", bias=bias_sym, **workspace)
        if t and t.lora_rank and module in t.lora_targets:
            r, adtype = t.lora_rank, t.lora_dtype
            lora_a = self.param(f"{layer}.{module}.lora_A", per_token_in * r, True, adtype)
            lora_b = self.param(f"{layer}.{module}.lora_B", r * per_token_out, True, adtype)
            xa = self.cast(x, adtype, per_token_in, f"{layer}.{module}.lora_in")
            hidden = self.linear(xa, lora_a, r, f"{layer}.{module}.lora_A", dtype=adtype)
            delta = self.linear(hidden, lora_b, per_token_out, f"{layer}.{module}.lora_B", dtype=adtype)
            scaled = self.pointwise([delta], per_token_out, f"{layer}.{module}.lora_scale", dtype=adtype)
            summed_dtype = FP32 if FP32 in (adtype, self.dtype) else self.dtype
            summed = self.add(out, scaled, per_token_out, f"{layer}.{module}.lora_add", dtype=summed_dtype)
            out = self.cast(summed, self.dtype, per_token_out, f"{layer}.{module}.lora_out")
        self.release(x)  # the caller's frame holds the module's argument until it returns (peft's forward casts
        return out       # its local copy to the adapter dtype: in bf16 both exist, e.g. down_proj's input)

    def rope(self, x: Sym, per_token: int, name: str) -> Sym:
        """``x*cos + rotate_half(x)*sin``: four temporaries, nothing saved but cos/sin (the model's shared
        tables, so they live until the first layer's backward)."""
        a = self.mul(x, self.rope_tables, per_token, f"{name}.cos")
        neg = self.pointwise([x], per_token // 2, f"{name}.neg")
        cat = self.pointwise([neg, x], per_token, f"{name}.cat")
        b = self.mul(cat, self.rope_tables, per_token, f"{name}.sin")
        return self.add(a, b, per_token, f"{name}.add")

    def sdpa_uses_math_kernel(self) -> bool:
        """Whether transformers' SDPA call runs torch's math kernel (:func:`sdpa_fused_kernel`)."""
        return self.attention_impl == "sdpa" and not sdpa_fused_kernel(self.spec, self.dtype, self.device)

    def attention_math(self, q: Sym, k: Sym, v: Sym, layer: int) -> Sym:
        """SDPA's math kernel: ``softmax((q*c) @ (repeat(k)^T*c) + mask) @ repeat(v)``, c = scale^0.5.

        The scores and the probabilities are heads x seq x seq per sequence; softmax saves the
        probabilities, the matmuls save the scaled q, the scaled repeated k and the repeated v.
        """
        s = self.spec
        scores_per_token = s.num_heads * self.seq  # heads x seq per query token
        qs = self.pointwise([q], s.q_dim, f"{layer}.math.q_scaled")
        k_rep = self.pointwise([k], s.q_dim, f"{layer}.math.k_repeat")
        v_rep = self.pointwise([v], s.q_dim, f"{layer}.math.v_repeat")
        ks = self.pointwise([k_rep], s.q_dim, f"{layer}.math.k_scaled")
        scores = self.act(f"{layer}.math.scores", scores_per_token, qs.requires_grad, FP32)
        self.op(f"{layer}.math.qk", [qs, ks], [scores], [qs, ks] if scores.requires_grad else [])
        # at::_safe_softmax: softmax, a bool mask of -inf scores (1 byte: a quarter of fp32), and
        # where(fully masked row, 0, softmax) as the saved result; its C++ locals live until it returns.
        soft = self.pointwise([scores], scores_per_token, f"{layer}.math.softmax", dtype=FP32)
        masked = self.act(f"{layer}.math.is_neg_inf", scores_per_token // 4, False, FP32)   # bool: no gradient
        self.op(f"{layer}.math.is_neg_inf", [scores], [masked], [])
        # On CUDA its backward holds one score tensor more than its gradients (H200: 3.0 score tensors above what the
        # forward left, against 2.03 on the CPU; benchmarks/sdpa_math_memory.py, d51ce43).
        extra = self._bytes(scores_per_token, FP32) if self.device == "cuda" else 0
        probs = self.pointwise([soft, masked], scores_per_token, f"{layer}.math.safe_softmax", saves_output=True,
                               dtype=FP32, backward_workspace=extra)
        for local in (scores, soft, masked):
            self.release(local)
        return self.mul(probs, v_rep, s.q_dim, f"{layer}.math.pv")

    def attention(self, q: Sym, k: Sym, v: Sym, layer: int) -> Sym:
        """SDPA (flash/cuDNN/CPU-flash) or memfit's attention: both save q, k, v, out and the fp32 log-sum-exp."""
        s = self.spec
        rg = q.requires_grad or k.requires_grad or v.requires_grad
        out = self.act(f"{layer}.sdpa", s.q_dim, rg)
        lse = self.act(f"{layer}.sdpa.lse", s.num_heads, rg, FP32)
        workspace = 0
        if self.attention_impl == "memfit":
            # memfit's two-pass backward: one fp32 delta = rowsum(dO * O) per head and token, no
            # accumulators (dK/dV per key block, then dQ per query block).
            workspace = self._bytes(s.num_heads, FP32)
        elif self.device == "cuda":
            # FlashAttention-2's backward accumulates dQ in fp32 and, for grouped-query
            # heads, writes dK/dV per query head before summing them per kv head.
            workspace = self._bytes(s.q_dim, FP32)
            if s.num_heads != s.num_kv_heads:
                workspace += 2 * self._bytes(s.q_dim, self.dtype)
        self.ops.append(Op(f"{layer}.sdpa", [q, k, v], [out, lse], [q, k, v, out, lse] if rg else [],
                           backward_workspace=workspace, segment=self.segment))
        return out

    def decoder_layer(self, x: Sym, layer: int, cache: list[Sym] | None = None) -> Sym:
        s, t = self.spec, self.trainable
        norms_trained = bool(t and t.norms)
        y = self.rms_norm(x, self.param(f"{layer}.input_layernorm", s.hidden, norms_trained), f"{layer}.norm1")
        q = self.projection(y, layer, "q_proj", s.hidden, s.q_dim)
        k = self.projection(y, layer, "k_proj", s.hidden, s.kv_dim)
        v = self.projection(y, layer, "v_proj", s.hidden, s.kv_dim)
        unrotated = (q, k)
        q = self.rope(q, s.q_dim, f"{layer}.rope_q")
        k = self.rope(k, s.kv_dim, f"{layer}.rope_k")
        for sym in unrotated:  # apply_rotary_pos_emb's caller holds both until it returns (in inference nothing saves
            self.release(sym)  # them: the replay had freed q at its last read, before k's rotation)
        if cache is not None:  # DynamicCache.update: torch.cat onto an empty tensor, i.e. a copy
            k = self.pointwise([k], s.kv_dim, f"{layer}.cache_k")
            v = self.pointwise([v], s.kv_dim, f"{layer}.cache_v")
            k.component = v.component = "kv_cache"
            cache += [k, v]
        attn = (self.attention_math if self.sdpa_uses_math_kernel() else self.attention)(q, k, v, layer)
        o = self.projection(attn, layer, "o_proj", s.q_dim, s.hidden)
        self.release(y)  # LlamaAttention.forward's argument
        x2 = self.add(x, o, s.hidden, f"{layer}.residual1")
        y2 = self.rms_norm(x2, self.param(f"{layer}.post_attention_layernorm", s.hidden, norms_trained),
                           f"{layer}.norm2")
        width = self.ffn_widths[layer]
        gate = self.projection(y2, layer, "gate_proj", s.hidden, width)
        up = self.projection(y2, layer, "up_proj", s.hidden, width)
        if self.fused_swiglu:
            prod = self.swiglu(gate, up, width, f"{layer}.swiglu")
        else:
            act = self.pointwise([gate], width, f"{layer}.silu", saves_input=True)
            prod = self.mul(act, up, width, f"{layer}.act_mul")
        down = self.projection(prod, layer, "down_proj", width, s.hidden)
        self.release(y2)  # LlamaMLP.forward's argument
        out = self.add(x2, down, s.hidden, f"{layer}.residual2")
        self.release(x)  # LlamaModel's loop variable holds the layer input until the layer returns
        return out

    def embed(self, rope_tokens: int | None = None) -> tuple[Sym, Sym]:
        """The embedding's op and the rope tables (``rope_tokens`` positions: transformers' are one row's, ``seq``)."""
        s, t = self.spec, self.trainable
        ids = Sym("input_ids", self.tokens * 8, False, "inputs", persistent=True)
        weight = self.param("embed_tokens", s.vocab * s.hidden, bool(t and t.embeddings))
        x = self.act("embed", s.hidden, weight.requires_grad)
        # CUDA's embedding backward of a 16-bit weight holds 4 bytes per weight element at its peak,
        # twice the gradient it returns (read off the allocator history: benchmarks/ledger_snapshot.py).
        workspace = 2 * s.vocab * s.hidden if self.device == "cuda" and dtype_bytes(self.dtype) == 2 else 0
        self.op("embed", [ids, weight], [x], [ids] if weight.requires_grad else [], backward_workspace=workspace)
        # RoPE's cos and sin, (1, seq, head_dim) each: the whole forward, and in training until the first
        # layer's backward (every rotation saves them; a checkpoint holds them)
        self.rope_tables = self.act("rope_cos_sin", 2 * s.head_dim, False,
                                    tokens=self.seq if rope_tokens is None else rope_tokens)
        self.op("rotary_emb", [], [self.rope_tables], [])
        self.inputs_embeds = x
        return x, weight

    # ---- memfit's decode loop (memfit.infer.generate.Generator) ---------------------------------------
    def loop_prefill_chunk(self, fused_qkv: bool, fused_mlp: list[bool], attention_workspace: int = 0) -> Sym:
        """The ops of one prefill chunk of memfit's decode loop (``Generator._forward`` over ``batch`` x ``seq``
        queries, no grad); returns the last token's logits. The loop's own lifetimes, not transformers': rope tables
        for every row, K/V written into the static cache (which the caller counts), a layer's attention a method
        whose q/k/v and output die when it returns (``Generator._attend``), each norm fused with the residual add
        before it (``_add_norm``: the loop's x and h are replaced when it returns), SDPA's output read by the o
        projection as a view on CUDA (its kernels' (B, T, heads, D) layout) and through a copy elsewhere (the CPU
        kernel's is (B, heads, T, D)). ``fused_qkv``/``fused_mlp``: the loader's fused layout (one q/k/v matmul, whose
        output stays whole until the attention returns; per layer, one gate/up matmul, silu and product in
        ``act_mul``). ``attention_workspace``: bytes each layer's attention builds and frees (on the CPU a later chunk's
        causal mask and torch's flash-attention scratch: ``predict._loop_chunk_cases``)."""
        x, embedding = self.embed(rope_tokens=self.tokens)
        h = self.rms_norm(x, self.param("0.input_layernorm", self.spec.hidden, False), "0.norm1")
        for layer in range(self.spec.num_layers):
            x, h = self._loop_add_norm(x, h, self._loop_attention(h, layer, fused_qkv, attention_workspace),
                                       f"{layer}.post_attention_layernorm", f"{layer}.norm2")
            last = layer + 1 == self.spec.num_layers
            x, h = self._loop_add_norm(x, h, self._loop_mlp(h, layer, fused_mlp[layer]),
                                       "norm" if last else f"{layer + 1}.input_layernorm",
                                       "final_norm" if last else f"{layer + 1}.norm1")
        weight = embedding if self.spec.tied_embeddings else self.param("lm_head", self.spec.vocab * self.spec.hidden,
                                                                        False)
        logits = self.linear(h, weight, self.spec.vocab, "lm_head", tokens=self.batch)   # h[:, -1:]
        logits.component = "logits"
        return logits

    def _loop_add_norm(self, x: Sym, h: Sym, delta: Sym, norm: str, name: str) -> tuple[Sym, Sym]:
        """``_add_norm(x, delta)``: the sum and its RMSNorm; the loop's old x and h, and delta (the call's argument),
        live until it returns."""
        total = self.add(x, delta, self.spec.hidden, f"{name}.residual")
        normed = self.rms_norm(total, self.param(norm, self.spec.hidden, False), name)
        for local in (x, h, delta):
            self.release(local)
        return total, normed

    def _loop_attention(self, h: Sym, layer: int, fused_qkv: bool, workspace: int) -> Sym:
        s = self.spec
        if fused_qkv:
            qkv = self._fused_linear(h, layer, {"q_proj": s.q_dim, "k_proj": s.kv_dim, "v_proj": s.kv_dim})
            q = k = v = qkv                            # views of the one output, which they hold until the return
        else:
            q = self.projection(h, layer, "q_proj", s.hidden, s.q_dim)
            k = self.projection(h, layer, "k_proj", s.hidden, s.kv_dim)
            v = self.projection(h, layer, "v_proj", s.hidden, s.kv_dim)
        q_rot = self.rope(q, s.q_dim, f"{layer}.rope_q")
        k_rot = self.rope(k, s.kv_dim, f"{layer}.rope_k")
        self.op(f"{layer}.cache_write", [k_rot, v], [], [])          # index_copy_ into the static cache
        self.release(q)                                               # _rope_and_cache's argument
        out = self.act(f"{layer}.sdpa", s.q_dim, False)
        lse = self.act(f"{layer}.sdpa.lse", s.num_heads, False, FP32)
        self.op(f"{layer}.sdpa", [q_rot], [out, lse], [], forward_workspace=workspace)   # over the cache's keys
        if self.device != "cuda":
            out = self.pointwise([out], s.q_dim, f"{layer}.merge_heads")
        o = self.projection(out, layer, "o_proj", s.q_dim, s.hidden)
        for local in (k, v, q_rot):              # _attend's locals, freed as it returns (fused: k is q/k/v's output)
            self.release(local)
        return o

    def _loop_mlp(self, h: Sym, layer: int, fused: bool) -> Sym:
        s, width = self.spec, self.ffn_widths[layer]
        if fused:
            gate_up = self._fused_linear(h, layer, {"gate_proj": width, "up_proj": width})
            act = self.pointwise([gate_up], width, f"{layer}.silu")
            prod = self.mul(act, gate_up, width, f"{layer}.act_mul")
        else:                                           # the module's own forward: down(act(gate(x)) * up(x))
            act = self.pointwise([self.projection(h, layer, "gate_proj", s.hidden, width)], width, f"{layer}.silu")
            prod = self.mul(act, self.projection(h, layer, "up_proj", s.hidden, width), width, f"{layer}.act_mul")
        return self.projection(prod, layer, "down_proj", width, s.hidden)

    def _fused_linear(self, x: Sym, layer: int, widths: dict[str, int]) -> Sym:
        """One matmul over the loader's shared buffer of ``widths``' projections (their weights and biases counted
        as each module's)."""
        params = [self.param(f"{layer}.{module}", self.spec.hidden * width, False) for module, width in widths.items()]
        params += [self.param(f"{layer}.{module}.bias", width, False) for module, width in widths.items()
                   if module in self.biased]
        out = self.act(f"{layer}.{'_'.join(widths)}", sum(widths.values()), False)
        self.op(out.name, [x, *params], [out], [])
        return out

    def final_hidden(self, x: Sym, embedding: Sym) -> tuple[Sym, Sym]:
        """The final norm's output and the output-projection weight (the embedding when tied)."""
        s, t = self.spec, self.trainable
        y = self.rms_norm(x, self.param("norm", s.hidden, bool(t and t.norms)), "final_norm")
        self.release(self.inputs_embeds)  # LlamaModel.forward holds inputs_embeds until it returns
        self.release(self.rope_tables)
        weight = embedding if s.tied_embeddings else self.param("lm_head", s.vocab * s.hidden,
                                                                  bool(t and t.embeddings))
        return y, weight

    def head(self, x: Sym, embedding: Sym, logits_tokens: int | None = None) -> Sym:
        """Final norm and lm_head; ``logits_tokens`` limits logits to the last tokens (inference)."""
        y, weight = self.final_hidden(x, embedding)
        tokens = None if logits_tokens is None else self.batch * logits_tokens  # a slice: a view of y
        logits = self.linear(y, weight, self.spec.vocab, "lm_head", tokens=tokens)
        logits.component = "logits"
        return logits

    def fused_linear_ce(self, x: Sym, embedding: Sym, loss_tokens: int, pytorch_path: bool = False) -> Sym:
        """Final norm, then ``memfit.kernels.linear_ce``: no logits ever exist.

        It saves the normalised hidden states and one fp32 log-sum-exp per token; its
        backward's transient buffers (a loss-tokens x chunk logit-gradient buffer when the
        weight is frozen; when it trains, a side buffer for the last vocabulary rows of at most
        max(TAIL_ELEMENTS, loss tokens x STEP_ALIGN) elements; the hidden-gradient finish's
        temporary of at most FINISH_ELEMENTS) are the kernel's own account,
        ``linear_ce.backward_memory``, for the op's Triton kernels or its PyTorch path (``pytorch_path``:
        chunked cuBLAS matmuls with buffers of their own, which fp32 on CUDA at torch's default IEEE
        precision runs; ``predict`` finds it by ``linear_ce.takes_pytorch_path``).
        """
        from memfit.kernels.linear_ce import backward_memory

        s = self.spec
        y, weight = self.final_hidden(x, embedding)
        lse = self.act("linear_ce.lse", 1, True, FP32, "logits")
        loss = Sym("loss", 4, True, "temporaries")
        memory = backward_memory(self.tokens, loss_tokens, s.hidden, s.vocab, dtype_bytes(self.dtype),
                                 weight_grad=weight.requires_grad, pytorch_path=pytorch_path)
        self.ops.append(Op("linear_ce", [y, weight], [loss, lse], [y, lse], backward_workspace=memory["transient"],
                           segment=self.segment))
        return loss

    def causal_lm_loss(self, logits: Sym) -> Sym:
        """transformers' ForCausalLMLoss: fp32 upcast, log_softmax (saves its output), nll."""
        v = self.spec.vocab
        labels = Sym("labels", self.tokens * 8, False, "inputs", persistent=True)
        up = self.cast(logits, FP32, v, "logits.float")
        up.component = "logits"
        logp = self.act("log_softmax", v, True, FP32, "logits")
        self.op("log_softmax", [up], [logp], [logp])
        loss = Sym("loss", 4, True, "temporaries")
        self.op("nll_loss", [logp, labels], [loss], [labels])
        return loss
