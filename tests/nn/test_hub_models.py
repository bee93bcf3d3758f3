"""Hub models run unchanged on global modules (worlds of 2 and 4): GPT-2, Llama and BERT
written as Hugging Face writes them (``tests/nn/hub_models.py``) build plain tensors in
their forwards (position ids, masks, rotary tables), which modules made global by
``gt.nn.to_global`` / ``gt.nn.fully_shard`` take as broadcast. Each trains in data
parallel, Megatron tensor parallel and fully_shard layouts to the parameters of one
plain process (1e-5); a submodule called on its own works too; the scope of the
implicit broadcast ends with the forward (also when it raises); the check mode catches
a plain tensor that differs between ranks. The real ``transformers`` models (a test
dependency; GPT-2, Llama, BERT and Mixtral, a mixture of experts) train the same way
and save with ``save_pretrained`` through ``gt.nn.full_state_dict``. World 4 runs the
Llama model only (its cost)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hub_models import MODELS, VOCAB, T, megatron_sbp
from mp import world_test

import globaltensor as gt

B, S = gt.sbp.broadcast, gt.sbp.split
# "sequence": parameters broadcast and the tokens split on the sequence (context
# parallel): attention of split q, k, v (written out, or SDPA) across the ranks
LAYOUTS = ("data_parallel", "sequence", "tensor_parallel", "fully_shard")


def _tokens(rows: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, T), generator=torch.Generator().manual_seed(1))


def make_global(model: torch.nn.Module, layout: str, split=None) -> torch.nn.Module:
    """``model`` (in place) in ``layout``; ``split`` maps a model to its Megatron sbps."""
    p = gt.placement.all("cpu")
    if layout in ("data_parallel", "sequence"):
        return gt.nn.to_global(model, p, B)
    if layout == "fully_shard":
        return gt.nn.fully_shard(model, p)
    megatron = (split or (lambda m: megatron_sbp(m, S, B)))(model)
    return gt.nn.to_global(model, p, lambda name, t: megatron.get(name, B))


def _batch(ids: torch.Tensor, layout: str):
    sbp = B if layout == "tensor_parallel" else S(1) if layout == "sequence" else S(0)
    return gt.tensor(ids, placement=gt.placement.all("cpu"), sbp=sbp)


def train(model, ids, loss_of, steps: int = 2) -> list:
    # SGD, not Adam: Adam scales the rounding noise of gradients that are zero in exact
    # arithmetic (GPT-2's key bias: softmax ignores a constant per row) up to the lr
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _next_token_loss(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def assert_trains_alike(model, reference, layout, losses, ref_losses, atol=1e-5):
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < atol, (layout, losses, ref_losses)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got.full(), want.detach(), rtol=1e-5, atol=atol,
                                   msg=lambda m, name=name: f"{layout} {name}: {m}")


def _check_model(kind: str):
    ids = _tokens()
    for layout in LAYOUTS:
        torch.manual_seed(0)
        reference = MODELS[kind]()
        model = make_global(copy.deepcopy(reference), layout)
        ref_losses = train(reference, ids, _next_token_loss)
        losses = train(model, _batch(ids, layout), _next_token_loss)
        assert_trains_alike(model, reference, layout, losses, ref_losses)
    if kind == "gpt2":   # the tensor-parallel layout really split the tied table
        assert model.wte.weight is model.lm_head.weight and model.wte.weight.sbp == (S(0),)


def check_gpt2_trains_unchanged():
    _check_model("gpt2")


def check_llama_trains_unchanged():
    _check_model("llama")


def check_bert_trains_unchanged():
    _check_model("bert")


def check_submodule_called_alone():
    """A layer called directly (not through the model) builds its own rotary tables and
    mask: its forward is in the implicit broadcast too."""
    torch.manual_seed(0)
    reference = MODELS["llama"]()
    model = make_global(copy.deepcopy(reference), "tensor_parallel")
    h = torch.randn(4, T, 16, generator=torch.Generator().manual_seed(2))
    got = model.layers[0](_batch(h, "tensor_parallel"))
    torch.testing.assert_close(got.full(), reference.layers[0](h), rtol=1e-5, atol=1e-5)


class _AddsPlain(torch.nn.Module):
    """A forward adding a plain tensor: the same on every rank, or (``per_rank``) not,
    which is not SPMD-safe."""

    def __init__(self, per_rank: bool):
        super().__init__()
        self.lin, self.per_rank = torch.nn.Linear(4, 4), per_rank

    def forward(self, x):
        return self.lin(x) + torch.full((4,), float(gt.get_rank() if self.per_rank else 1))


def check_scope_ends_with_forward_and_check_mode_verifies():
    p = gt.placement.all("cpu")
    model = gt.nn.to_global(_AddsPlain(per_rank=True), p, B)
    x = gt.randn(2, 4, placement=p, sbp=S(0))
    model(x)                                 # plain operand taken as broadcast
    with pytest.raises(ValueError, match="implicit_broadcast"):
        x + torch.ones(2, 4)                 # outside the forward: not any more
    with pytest.raises(RuntimeError):
        model(gt.randn(2, 5, placement=p, sbp=S(0)))   # forward raises: scope closed too
    with pytest.raises(ValueError, match="implicit_broadcast"):
        x + torch.ones(2, 4)
    with gt.debug.check_consistency():
        with pytest.raises(gt.debug.DivergenceError, match="plain operand"):
            model(x)
    same = gt.nn.to_global(_AddsPlain(per_rank=False), p, B)
    with gt.debug.check_consistency():       # equal plain tensors pass the check
        same(x)


CHECKS = ["check_gpt2_trains_unchanged", "check_llama_trains_unchanged",
          "check_bert_trains_unchanged", "check_submodule_called_alone",
          "check_scope_ends_with_forward_and_check_mode_verifies"]

# world 4 (oversubscribed, seconds per model): heads split four ways in one model
CHECKS_IN_4 = ["check_llama_trains_unchanged", "check_submodule_called_alone",
               "check_scope_ends_with_forward_and_check_mode_verifies"]

test_world2, test_world4 = world_test(__name__, 2, CHECKS), world_test(__name__, 4, CHECKS_IN_4)


# ------------------------------------------------------------- real transformers models
_HF_COLUMN = (r"(c_attn|c_fc|q_proj|k_proj|v_proj|gate_proj|up_proj|query|key|value|"
              r"intermediate\.dense)\.(weight|bias)$")
_HF_ROW = r"(c_proj|o_proj|down_proj|attention\.output\.dense|[0-9]\.output\.dense)\.weight$"


def _hf_megatron(model) -> dict:
    """Megatron sbps of a transformers model by parameter name (GPT-2's Conv1D weights
    are (in, out); its fused query-key-value ``c_attn`` split in 3 blocks, each rank
    holding its heads of each)."""
    import re
    conv1d = type(model).__name__.startswith("GPT2")
    layout = {}
    for name, t in model.named_parameters():
        if name.endswith("experts.gate_up_proj"):    # (experts, out, in): a mixture's experts
            layout[name] = S(1)                       # column- and row-parallel, as F.grouped_mm
        elif name.endswith("experts.down_proj"):      # runs them (the experts' dim stays whole)
            layout[name] = S(2)
        elif re.search(_HF_COLUMN, name):
            blocks = 3 if "c_attn" in name else 1
            layout[name] = S(1 if conv1d and t.dim() == 2 else 0, blocks=blocks)
        elif re.search(_HF_ROW, name):
            layout[name] = S(0) if conv1d else S(1)
    return layout


def _hf_models():
    import transformers as tf
    tiny = dict(vocab_size=VOCAB, attn_implementation="sdpa")
    torch.manual_seed(0)            # every rank's reference is the same model
    yield tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=16, n_layer=2, n_head=4, n_positions=T,
                                           bos_token_id=0, eos_token_id=0, **tiny))
    yield tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=T, **tiny))
    yield tf.BertForMaskedLM(tf.BertConfig(hidden_size=16, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=32,
                                           max_position_embeddings=T, **tiny))
    # a mixture of experts (transformers runs its experts as F.grouped_mm over token
    # groups, its router as topk, sort, histc and integer indexing)
    yield tf.MixtralForCausalLM(tf.MixtralConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=T, **tiny))


def _hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def check_transformers_models_train_unchanged():
    import tempfile
    ids = _tokens()
    for reference in _hf_models():
        reference.eval()    # no dropout: the same computation in every layout
        for layout in LAYOUTS:
            model = make_global(copy.deepcopy(reference), layout, split=_hf_megatron)
            trained = copy.deepcopy(reference)
            ref_losses = train(trained, ids, _hf_loss)
            losses = train(model, _batch(ids, layout), _hf_loss)
            assert_trains_alike(model, trained, f"{type(model).__name__} {layout}", losses,
                                ref_losses)
        # save_pretrained of the (fully sharded) global model: whole values on rank 0
        got = model(input_ids=_batch(ids, "data_parallel")).logits.full()
        with tempfile.TemporaryDirectory() as tmp:
            with pytest.raises(TypeError, match="gt.nn.full_state_dict"):
                model.save_pretrained(tmp)
            state = gt.nn.full_state_dict(model)
            if gt.get_rank() == 0:
                model.save_pretrained(tmp, state_dict=state)
                loaded = type(model).from_pretrained(tmp).eval()
                with torch.no_grad():
                    torch.testing.assert_close(got, loaded(input_ids=ids).logits,
                                               rtol=1e-5, atol=1e-5)


def check_transformers_generate_gives_one_process_tokens():
    # generate() builds plain tensors outside the model's forward (the tokens it appends,
    # its stopping flags) and mixes them with the global logits: a converted model's
    # generate runs inside gt.implicit_broadcast() as its forward does, greedily to one
    # process's tokens, with no context manager (it raised a ValueError), and so does a
    # deep copy's (the copy's own, not the original's). Made Megatron-style, each
    # all-reduces each layer's two row-parallel outputs per token and sends nothing
    # else, as Megatron does (each token is decided op by op: it reduce-scattered them,
    # and the next projections gathered them again; GPT-2's fused projection, split in
    # three blocks, parts locally)
    prompt = _tokens()[:, :4]
    for reference in list(_hf_models())[:2]:      # GPT-2, Llama
        reference.eval()
        want = reference.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
        for layout in ("data_parallel", "tensor_parallel"):
            model = make_global(copy.deepcopy(reference), layout, split=_hf_megatron)
            for which in (model, copy.deepcopy(model)):
                assert which.generate.__self__ is which
                with gt.debug.comm_stats() as sent:
                    got = which.generate(_batch(prompt, layout), max_new_tokens=3,
                                         do_sample=False, pad_token_id=0)
                assert torch.equal(got.full(), want), (type(model).__name__, layout)
                if layout == "tensor_parallel":
                    assert dict(sent.calls) == {"all_reduce": 2 * 2 * 3}, sent


def check_transformers_init_weights_after_meta_init():
    # Built under gt.nn.meta_init(), a transformers model's post_init() ran its
    # initialisers on meta parameters and marked its modules initialised, so
    # init_weights() after to_global skipped them: every weight stayed zero. Now it
    # fills them, the vocabulary-split padding row included, whatever the layout.
    import transformers as tf
    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=32, pad_token_id=3)
    filled = []
    for sbp in (lambda name, t: S(0) if "word_embeddings" in name else B, lambda n, t: B):
        with gt.nn.meta_init():
            model = tf.BertModel(config)
        gt.nn.to_global(model, gt.placement.all("cpu"), sbp)
        gt.manual_seed(0)
        model.init_weights()
        filled.append({n: t.full() for n, t in model.named_parameters()})
    for name, value in filled[0].items():
        torch.testing.assert_close(value, filled[1][name])   # placement-invariant draws
        if name.endswith("dense.weight"):
            assert 0.01 < float(value.std()) < 0.03, (name, float(value.std()))
    embeddings = filled[0]["embeddings.word_embeddings.weight"]
    assert float(embeddings.std()) > 0.01 and not embeddings[3].any()


# GPT2LMHeadModel, LlamaForCausalLM and BertForMaskedLM from tiny configs, unchanged, in
# the session's world of 2 (transformers is in the test extra: CI runs them).
test_transformers_models_train_unchanged = world_test(
    __name__, 2, ["check_transformers_models_train_unchanged",
                  "check_transformers_generate_gives_one_process_tokens",
                  "check_transformers_init_weights_after_meta_init"])
