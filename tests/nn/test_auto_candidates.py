"""auto_parallel's candidates read from a model's structure: Megatron's pattern of
projections (``nn/auto_candidates.py``), checked on small modules and on Hugging Face
models against Megatron's layouts written by hand (GPT-2's, Llama's and Bert's are those
that ``test_hub_models`` trains)."""


def test_megatron_pairs_in_sequentials_chain_and_in_modules_fan_in():
    from torch import nn

    from globaltensor.nn.auto_candidates import _megatron_pairs
    flat = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.ReLU())][:-1])
    assert _megatron_pairs(flat) == ({"2": 1, "6": 1}, {"0": (0, 1), "4": (0, 1)})

    class Attention(nn.Module):
        def __init__(self, q=8, kv=8, fused=0):
            super().__init__()
            if fused:
                self.qkv = nn.Linear(8, fused)
            else:
                self.q, self.k, self.v = nn.Linear(8, q), nn.Linear(8, kv), nn.Linear(8, kv)
            self.proj = nn.Linear(8, 8)
    assert _megatron_pairs(Attention()) == ({"proj": 1}, {"q": (0, 1), "k": (0, 1), "v": (0, 1)})
    # grouped-query attention: keys and values with fewer heads are column-parallel too
    assert _megatron_pairs(Attention(kv=2)) == ({"proj": 1}, {"q": (0, 1), "k": (0, 1), "v": (0, 1)})
    # a fused query-key-value projection splits in 3 blocks (each rank its heads of each)
    assert _megatron_pairs(Attention(fused=24)) == ({"proj": 1}, {"qkv": (0, 3)})
    assert _megatron_pairs(Attention(fused=40)) == ({}, {})   # 5 x: not a fused projection
    assert _megatron_pairs(nn.Sequential(nn.Linear(4, 8), nn.Linear(6, 2))) == ({}, {})


def test_tensor_parallel_candidates_of_hub_models_are_megatrons():
    """Hugging Face GPT-2 (``Conv1D`` weights (in, out), a fused ``c_attn``), Llama
    (grouped-query attention, a gated MLP), Bert (its pattern across modules) and Phi-3
    (fused query-key-value and gate-up projections, in 3 and 2 blocks): the
    tensor-parallel candidate lays every projection out as Megatron does, each of
    GPT-2's query, key and value split by heads (``split(1, blocks=3)``); the rest
    broadcast."""
    import transformers as tf

    import globaltensor as gt
    from globaltensor.nn.auto_candidates import candidate_layouts
    S, B = gt.sbp.split, gt.sbp.broadcast
    tiny = dict(vocab_size=32, num_hidden_layers=1)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=16, n_head=4, n_positions=8, n_layer=1,
                                            vocab_size=32, bos_token_id=0, eos_token_id=0))
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=16, intermediate_size=32,
                                               num_attention_heads=4, num_key_value_heads=2,
                                               **tiny))
    bert = tf.BertForMaskedLM(tf.BertConfig(hidden_size=16, num_attention_heads=4,
                                            intermediate_size=32, **tiny))
    # (Phi-3 defines its output projection before its fused query-key-value one)
    phi3 = tf.Phi3ForCausalLM(tf.Phi3Config(hidden_size=16, intermediate_size=32,
                                            num_attention_heads=4, num_key_value_heads=4,
                                            pad_token_id=0, **tiny))
    expected = {gpt2: {"attn.c_attn.weight": S(1, blocks=3), "attn.c_attn.bias": S(0, blocks=3),
                       "attn.c_proj.weight": S(0), "mlp.c_fc.weight": S(1),
                       "mlp.c_fc.bias": S(0), "mlp.c_proj.weight": S(0)},
                llama: {f"{m}.weight": S(0) for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                      "self_attn.v_proj", "mlp.gate_proj",
                                                      "mlp.up_proj")}
                | {"self_attn.o_proj.weight": S(1), "mlp.down_proj.weight": S(1)},
                # query, key and value in one module, their output projection in the
                # next; the MLP's two projections in one module each
                bert: {f"{m}.{w}": S(0) for m in ("attention.self.query", "attention.self.key",
                                                  "attention.self.value", "intermediate.dense")
                       for w in ("weight", "bias")}
                | {"attention.output.dense.weight": S(1), "output.dense.weight": S(1)},
                phi3: {"self_attn.qkv_proj.weight": S(0, blocks=3),
                       "self_attn.o_proj.weight": S(1),
                       "mlp.gate_up_proj.weight": S(0, blocks=2), "mlp.down_proj.weight": S(1)}}
    for model, layer in expected.items():
        layouts, _ = candidate_layouts(model, gt.placement("cpu", [0, 1]),
                                       (_ids(),))["tensor parallel"]
        split = {name.split(".0.", 1)[1]: sbp[0] for name, sbp in layouts.items()
                 if sbp != (B,)}
        assert split == layer, (type(model).__name__, split)


def _ids():
    import torch
    return torch.zeros(2, 8, dtype=torch.long)
