"""A minimal PyTorch LLaMA: what a user writes instead of using a framework.

The third peer of tools/bench/train_throughput.py, beside megalite and HF's
LlamaForCausalLM. Plain PyTorch, read top to bottom:
- separate bias-free nn.Linear projections (q, k, v, o; gate, up, down);
- RMSNorm (nn.RMSNorm, i.e. F.rms_norm) before attention, before the MLP and at the end;
- rotary embeddings in HF's rotate-half convention (channel i pairs with i + d/2);
- F.scaled_dot_product_attention, causal, with enable_gqa for grouped-query attention;
- SwiGLU: down(silu(gate(x)) * up(x));
- an untied output layer (tied when asked, for presets that tie), and the loss inside
  forward: F.cross_entropy on fp32 logits, the mean over the batch's tokens.
Layout `[batch, seq, hidden]`. Weights are normal(0, 0.02) and norms 1, so the loss at
init is about ln(vocab). Build it straight in its dtype and on its device (`dtype`,
`device`), as nn layers take them; the rotary frequencies stay fp32.
"""

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, groups: int, **factory):
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, hidden // heads
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False, **factory)
        self.k = nn.Linear(hidden, groups * self.head_dim, bias=False, **factory)
        self.v = nn.Linear(hidden, groups * self.head_dim, bias=False, **factory)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False, **factory)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [b, heads, s, d]
        k = self.k(x).view(b, s, self.groups, self.head_dim).transpose(1, 2)  # [b, groups, s, d]
        v = self.v(x).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.groups != self.heads)
        return self.o(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, **factory):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False, **factory)
        self.up = nn.Linear(hidden, ffn, bias=False, **factory)
        self.down = nn.Linear(ffn, hidden, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int, heads: int, groups: int, eps: float, **factory):
        super().__init__()
        self.attention_norm = nn.RMSNorm(hidden, eps=eps, **factory)
        self.attention = Attention(hidden, heads, groups, **factory)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps, **factory)
        self.mlp = MLP(hidden, ffn, **factory)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class MinimalLlama(nn.Module):
    """forward(tokens [b, s], labels [b, s], positions [b, s]) -> the mean loss (fp32 scalar).

    inv_freq: the rotary frequencies `[head_dim / 2]` (default rope_theta^(-2j/d)), for
    scaled variants such as Llama 3.1's.
    """

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, groups: int, ffn: int,
                 rope_theta: float = 10000.0, eps: float = 1e-5, tied: bool = False,
                 inv_freq: torch.Tensor | None = None, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embedding = nn.Embedding(vocab, hidden, **factory)
        self.layers = nn.ModuleList(Block(hidden, ffn, heads, groups, eps, **factory) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=eps, **factory)
        self.output = nn.Linear(hidden, vocab, bias=False, **factory)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if tied:
            self.output.weight = self.embedding.weight
        head_dim = hidden // heads
        if inv_freq is None:
            inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float().to(device), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        freqs = positions[..., None].float() * self.inv_freq  # [b, s, d/2], fp32
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [b, 1, s, d]: one table for every head
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
