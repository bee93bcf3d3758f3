"""Tiny GPT-2, Llama and BERT written the way Hugging Face and nanoGPT write them, for the
tests that global modules run hub models unchanged: their forwards build plain tensors
(``torch.arange`` position ids, masks from ``ones``/``tril``/``full(...).triu``, rotary
cos/sin, ``token_type_ids`` zeros, the extended attention mask), GPT-2's Conv1D keeps
its weight as (in, out) and runs ``addmm``, embeddings are tied to the output head.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, C, HEADS, T, LAYERS = 32, 16, 4, 8, 2
HD = C // HEADS

# Megatron tensor parallelism by module name: column-parallel (output features split),
# row-parallel (input features split); a Conv1D holds its weight transposed.
COLUMN = {"c_attn", "c_fc", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query",
          "key", "value", "intermediate"}
ROW = {"c_proj", "o_proj", "down_proj", "attn_out", "output"}
VOCAB_PARALLEL = {"wte", "word_embeddings"}     # rows of the (tied) embedding table


def megatron_sbp(model: nn.Module, split, broadcast) -> dict:
    """{parameter name: sbp} of the Megatron layout; names not in it are broadcast."""
    layout = {}
    for name, module in model.named_modules():
        last, conv1d = name.rsplit(".", 1)[-1], isinstance(module, Conv1D)
        if last in COLUMN:
            layout[f"{name}.weight"] = split(1 if conv1d else 0)
            layout[f"{name}.bias"] = split(0)
        elif last in ROW:
            layout[f"{name}.weight"] = split(0 if conv1d else 1)
        elif last in VOCAB_PARALLEL:
            layout[f"{name}.weight"] = split(0)
    return layout


def _heads(x: torch.Tensor) -> torch.Tensor:
    """(B, T, C) -> (B, heads, T, head dim)."""
    b, t, _ = x.size()
    return x.view(b, t, HEADS, HD).transpose(1, 2)


def _merge(y: torch.Tensor) -> torch.Tensor:
    b, _, t, _ = y.size()
    return y.transpose(1, 2).contiguous().view(b, t, C)


# ---------------------------------------------------------------------------- GPT-2
class Conv1D(nn.Module):
    """transformers' GPT-2 Conv1D: a linear layer whose weight is stored (in, out)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = Conv1D(3 * C, C), Conv1D(C, C)
        # nanoGPT's causal mask, a buffer made in __init__
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool)).view(1, 1, T, T)
        self.register_buffer("bias", causal, persistent=False)

    def forward(self, x):
        _, t, _ = x.size()
        q, k, v = (_heads(a) for a in self.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HD))
        mask_value = torch.full([], torch.finfo(att.dtype).min, dtype=att.dtype)
        att = torch.where(self.bias[:, :, :t, :t], att, mask_value)
        return self.c_proj(_merge(F.softmax(att, dim=-1) @ v))


class GPT2Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(C), GPT2Attention(), nn.LayerNorm(C)
        self.c_fc, self.c_proj = Conv1D(4 * C, C), Conv1D(C, 4 * C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, C), nn.Embedding(T, C)
        self.h = nn.ModuleList(GPT2Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight              # tied

    def forward(self, idx):
        position_ids = torch.arange(0, idx.size(-1), dtype=torch.long).unsqueeze(0)
        x = self.wte(idx) + self.wpe(position_ids)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---------------------------------------------------------------------------- Llama
class RMSNorm(nn.Module):
    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(C)), eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    def __init__(self, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, HD, 2, dtype=torch.int64).float() / HD))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


class LlamaAttention(nn.Module):
    """Builds its own position ids, rotary tables and causal mask (so the layer runs
    alone too)."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(C, C, bias=False) for _ in range(4))
        self.rotary = Rotary()

    def forward(self, x):
        _, t, _ = x.size()
        q, k, v = _heads(self.q_proj(x)), _heads(self.k_proj(x)), _heads(self.v_proj(x))
        position_ids = torch.arange(t).unsqueeze(0)
        cos, sin = (a.unsqueeze(1) for a in self.rotary(x, position_ids))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        mask = torch.full((t, t), torch.finfo(x.dtype).min).triu(1)
        return self.o_proj(_merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


class LlamaLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(), LlamaAttention()
        self.post_attention_layernorm = RMSNorm()
        self.gate_proj = nn.Linear(C, 2 * C, bias=False)
        self.up_proj = nn.Linear(C, 2 * C, bias=False)
        self.down_proj = nn.Linear(2 * C, C, bias=False)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))   # SwiGLU


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, C)
        self.layers = nn.ModuleList(LlamaLayer() for _ in range(LAYERS))
        self.norm, self.lm_head = RMSNorm(), nn.Linear(C, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# ---------------------------------------------------------------------------- BERT
class BertLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(C, C) for _ in range(3))
        self.attn_out, self.ln_attn = nn.Linear(C, C), nn.LayerNorm(C)
        self.intermediate, self.output = nn.Linear(C, 2 * C), nn.Linear(2 * C, C)
        self.ln_out = nn.LayerNorm(C)

    def forward(self, x, extended_mask):
        q, k, v = _heads(self.query(x)), _heads(self.key(x)), _heads(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(HD) + extended_mask
        x = self.ln_attn(x + self.attn_out(_merge(F.softmax(scores, dim=-1) @ v)))
        return self.ln_out(x + self.output(F.gelu(self.intermediate(x))))


class Bert(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings, self.position_embeddings = nn.Embedding(VOCAB, C), nn.Embedding(T, C)
        self.token_type_embeddings, self.ln = nn.Embedding(2, C), nn.LayerNorm(C)
        self.register_buffer("position_ids", torch.arange(T).expand((1, -1)), persistent=False)
        self.layers = nn.ModuleList(BertLayer() for _ in range(LAYERS))
        self.decoder = nn.Linear(C, VOCAB)
        self.decoder.weight = self.word_embeddings.weight   # tied MLM head

    def forward(self, idx):
        b, t = idx.size()
        token_type_ids = torch.zeros((b, t), dtype=torch.long)
        attention_mask = torch.ones((b, t))
        extended = (1.0 - attention_mask[:, None, None, :]) * torch.finfo(torch.float32).min
        x = self.word_embeddings(idx) + self.token_type_embeddings(token_type_ids) \
            + self.position_embeddings(self.position_ids[:, :t])
        x = self.ln(x)
        for layer in self.layers:
            x = layer(x, extended)
        return self.decoder(x)


MODELS = {"gpt2": GPT2, "llama": Llama, "bert": Bert}
