"""Hugging Face ``transformers`` architectures swept over layouts in a simulated world: a
tool for finding what a new user of a hub model meets, not part of the suite (a second
or two per model and layout).

Each model is built from a tiny config (the same weights on every rank), made global in
each layout, run forward and backward once on a batch of tokens (or images), and
compared with one plain process: the loss, and every parameter's gradient. Layouts:
``dp`` (parameters broadcast, the batch split), ``seq`` (the tokens split on the
sequence), ``fsdp`` (``gt.nn.fully_shard``), ``split0`` and ``splitlast`` (every
parameter split on its first or last dim where it is large enough: any layout must
give the plain values). One line per model and layout: OK, WRONG (a wrong value: a
bug) or ERR (an exception).

    python tests/hub_sweep.py                                 # every model, every layout
    python tests/hub_sweep.py --models LlamaForCausalLM,MixtralForCausalLM --layouts seq
    python tests/hub_sweep.py --attn eager --checkpointing    # attention written out, recomputed
    python tests/hub_sweep.py --autocast                      # bfloat16 autocast (looser tolerance)
    python tests/hub_sweep.py --generate                      # greedy generate with the cache, tokens compared

Known reports that are not bugs: with ``--autocast``, gradients past the tolerance in
split layouts where products over a split dim are rounded per part (T5).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import time
import traceback
import warnings

import torch

import globaltensor as gt

B, S = gt.sbp.broadcast, gt.sbp.split
MODELS = ("LlamaForCausalLM,MistralForCausalLM,Qwen2ForCausalLM,Qwen3ForCausalLM,GemmaForCausalLM,"
          "Gemma2ForCausalLM,Gemma3ForCausalLM,PhiForCausalLM,Phi3ForCausalLM,OPTForCausalLM,"
          "GPTNeoXForCausalLM,GPTJForCausalLM,FalconForCausalLM,BloomForCausalLM,GPT2LMHeadModel,"
          "GPTNeoForCausalLM,GPTBigCodeForCausalLM,CodeGenForCausalLM,StableLmForCausalLM,"
          "OlmoForCausalLM,Olmo2ForCausalLM,CohereForCausalLM,GraniteForCausalLM,SmolLM3ForCausalLM,"
          "Starcoder2ForCausalLM,Ernie4_5ForCausalLM,MixtralForCausalLM,Qwen2MoeForCausalLM,"
          "Qwen3MoeForCausalLM,GptOssForCausalLM,MambaForCausalLM,BertForMaskedLM,RobertaForMaskedLM,"
          "DistilBertForMaskedLM,AlbertForMaskedLM,ElectraForMaskedLM,DebertaV2ForMaskedLM,"
          "ModernBertForMaskedLM,T5ForConditionalGeneration,BartForConditionalGeneration,"
          "PegasusForConditionalGeneration,ViTForImageClassification,SwinForImageClassification,"
          "ResNetForImageClassification,Dinov2Model")
# Small values for every config field of these names that a config has.
SMALL = dict(hidden_size=16, n_embd=16, d_model=16, dim=16, embed_dim=16, num_hidden_layers=2, n_layer=2,
             num_layers=2, num_decoder_layers=2, encoder_layers=2, decoder_layers=2, num_attention_heads=4,
             n_head=4, n_heads=4, num_heads=4, encoder_attention_heads=4, decoder_attention_heads=4,
             num_key_value_heads=2, intermediate_size=32, hidden_dim=32, n_inner=32, d_ff=32, ffn_dim=32,
             encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=64, max_position_embeddings=32,
             n_positions=32, head_dim=4, d_kv=4, rotary_dim=4, word_embed_proj_dim=16, num_experts=4,
             num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             shared_expert_intermediate_size=16, image_size=16, patch_size=4, num_channels=3,
             embedding_size=16, sliding_window=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             decoder_start_token_id=0, global_attn_every_n_layers=1)
OVERRIDES = {"GPTNeo": dict(attention_types=[[["global", "local"], 1]]),
             "Swin": dict(embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2),
             "ResNet": dict(hidden_sizes=[8, 16], depths=[1, 1])}
TOKENS = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(1))
PIXELS = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))


def build(name: str, attn: str | None, checkpointing: bool) -> torch.nn.Module:
    """The model from a tiny config, dropout off (the ranks' draws differ from one
    process's), the same weights on every call."""
    import transformers
    cls = getattr(transformers, name)
    fields = cls.config_class().to_dict()
    kwargs = {k: v for k, v in SMALL.items() if k in fields}
    kwargs.update(next((o for prefix, o in OVERRIDES.items() if name.startswith(prefix)), {}))
    config = cls.config_class(**kwargs)
    for k, v in config.to_dict().items():
        if "drop" in k and isinstance(v, float):   # (GPT-2's resid_pdrop, Swin's drop_path_rate too)
            setattr(config, k, 0.0)
    config.num_labels = 5
    if getattr(config, "decoder_start_token_id", None) is None:   # (T5's config lacks one)
        config.decoder_start_token_id = 0
    if attn:
        config._attn_implementation = attn
    torch.manual_seed(0)
    model = cls(config).eval()
    if checkpointing:
        model.train()    # (transformers checkpoints in training only)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def inputs(name: str) -> dict:
    if "Image" in name or "Dinov2" in name:
        return dict(pixel_values=PIXELS, **({"labels": torch.arange(4)} if "Classification" in name else {}))
    return dict(input_ids=TOKENS, labels=TOKENS)


def loss_of(out) -> torch.Tensor:
    if getattr(out, "loss", None) is not None:
        return out.loss
    return out.last_hidden_state.float().square().mean()


def make_global(model, layout: str, n: int):
    p = gt.placement.all("cpu")
    if layout in ("dp", "seq"):
        return gt.nn.to_global(model, p, B)
    if layout == "fsdp":
        return gt.nn.fully_shard(model, p)
    if layout == "split0":
        return gt.nn.to_global(model, p, lambda name, t: S(0) if t.dim() and t.shape[0] >= n else B)
    return gt.nn.to_global(model, p, lambda name, t: S(t.dim() - 1) if t.dim() > 1 and t.shape[-1] >= n else B)


def batch_sbp(layout: str, key: str):
    if layout == "seq" and key in ("input_ids", "labels"):
        return S(1)
    return B if layout in ("split0", "splitlast") else S(0)


def compare(name: str, layout: str, opts) -> str:
    reference = build(name, opts.attn, opts.checkpointing)
    data = inputs(name)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if opts.autocast else contextlib.nullcontext
    tol = (2e-2, 5e-2, 5e-3) if opts.autocast else (1e-4, 1e-3, 1e-5)   # loss, grad rtol, grad atol
    plain = copy.deepcopy(reference)
    with autocast():
        want = loss_of(plain(**data))
    want.backward()
    grads = {k: p.grad for k, p in plain.named_parameters()}

    def rank():
        model = make_global(copy.deepcopy(reference), layout, opts.ranks)
        p = gt.placement.all("cpu")
        with autocast():
            loss = loss_of(model(**{k: gt.tensor(v, placement=p, sbp=batch_sbp(layout, k))
                                    for k, v in data.items()}))
        loss.backward()
        bad = []
        got = float(loss.detach().full())
        if abs(got - float(want)) > tol[0] * max(1.0, abs(float(want))):
            bad.append(f"loss {got} vs {float(want)}")
        for k, param in model.named_parameters():
            g, w = param.grad, grads.get(k)
            if (g is None) != (w is None):
                bad.append(f"{k}: gradient {'missing' if g is None else 'where torch has none'}")
            elif g is not None and not torch.allclose(g.full(), w, rtol=tol[1], atol=tol[2]):
                bad.append(f"{k}: gradient off by {float((g.full() - w).abs().max()):.2e}")
        return bad

    bad = gt.testing.simulated_world(opts.ranks, timeout=120)(rank)[0]
    return "OK" if not bad else "WRONG " + "; ".join(bad[:3]) + (f" (+{len(bad) - 3})" if len(bad) > 3 else "")


def generated(name: str, layout: str, opts) -> str:
    """``model.generate`` (greedy, a few new tokens, the key-value cache on) of the global
    model against one process's: the same tokens."""
    reference = build(name, opts.attn, False)
    prompt = TOKENS[:, :5]
    want = reference.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)

    def rank():
        model = make_global(copy.deepcopy(reference), layout, opts.ranks)
        p = gt.placement.all("cpu")
        got = model.generate(gt.tensor(prompt, placement=p, sbp=batch_sbp(layout, "input_ids")),
                             max_new_tokens=4, do_sample=False, pad_token_id=0)
        got = got.full() if gt.is_global(got) else got
        return None if torch.equal(got, want) else f"tokens {got.tolist()} vs {want.tolist()}"

    bad = gt.testing.simulated_world(opts.ranks, timeout=120)(rank)[0]
    return "OK" if bad is None else "WRONG " + bad[:300]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=MODELS, help="comma-separated transformers classes")
    parser.add_argument("--layouts", default="dp,seq,fsdp,split0,splitlast")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--attn", default=None,
                        help="attn_implementation (eager, sdpa; default: transformers' choice)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (non-reentrant)")
    parser.add_argument("--autocast", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--generate", action="store_true",
                        help="greedy generate (key-value cache) instead of a training step; generative models only")
    opts = parser.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    for name in opts.models.split(","):
        for layout in opts.layouts.split(","):
            if layout == "seq" and "input_ids" not in inputs(name):
                continue
            if opts.checkpointing and not getattr(transformers, name).supports_gradient_checkpointing:
                continue
            if opts.generate and not getattr(transformers, name).can_generate():
                continue
            start = time.time()
            try:
                result = (generated if opts.generate else compare)(name, layout, opts)
            except Exception as e:  # noqa: BLE001  (a tool: every failure is a line)
                lines = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
                result = "ERR " + " | ".join(lines[:4])[:500]
            print(f"{name:34s} {layout:9s} {result} ({time.time() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
