"""InternLM2 causal LM (dsexp's own implementation of the published architecture).

Layout and names follow InternLM2 checkpoints: `model.tok_embeddings`, `model.layers.N.attention.wqkv`
(rows grouped per key/value head: [q x groups, k, v] for each KV head), `attention.wo`,
`feed_forward.w1/w3/w2` (SwiGLU), `attention_norm`, `ffn_norm`, `model.norm`, `output`.
As in InternLM2, every attention module keeps its own rotary tables (cos/sin for all positions up to
`max_position_embeddings`) as non-persistent buffers.

Tensor parallelism changes the local head counts: DeepSpeed's AutoTP divides `num_heads`,
`num_key_value_heads` and `hidden_size` on the attention module, transformers' TP leaves them whole.
The forward pass therefore takes the local head count from the projection's output, never from them.

Works with transformers 5.17 (cache argument `past_key_values`) and 5.2x (renamed `cache`).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

try:
    from .configuration_internlm2 import InternLM2Config
except ImportError:  # imported as a top-level module (not through a package)
    from configuration_internlm2 import InternLM2Config

# Name of the key/value cache in model outputs and forward kwargs for the installed transformers.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class InternLM2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class InternLM2RotaryEmbedding(nn.Module):
    """inv_freq and the cos/sin tables, all non-persistent buffers computed from the config."""

    def __init__(self, dim, max_position_embeddings=2048, base=10000.0):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)
        self._set_cos_sin_cache(max_position_embeddings, self.inv_freq.device, torch.get_default_dtype())

    def compute_inv_freq(self, device=None):
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64, device=device).float() / self.dim
        return 1.0 / (self.base**exponents)

    def _tables(self, seq_len, device):
        t = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.compute_inv_freq(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        cos, sin = self._tables(seq_len, device)
        self.register_buffer("cos_cached", cos.to(dtype), persistent=False)
        self.register_buffer("sin_cached", sin.to(dtype), persistent=False)

    @torch.no_grad()
    def reset_buffers(self):
        """Recompute every buffer in place (keeps device and dtype), e.g. after they were allocated empty."""
        device = self.inv_freq.device
        self.inv_freq.copy_(self.compute_inv_freq(device))
        cos, sin = self._tables(self.cos_cached.shape[0], device)
        self.cos_cached.copy_(cos)
        self.sin_cached.copy_(sin)

    def forward(self, x, seq_len):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len, x.device, x.dtype)
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)  # [bs, 1, seq, dim]
    sin = sin[position_ids].unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class InternLM2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class InternLM2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.wqkv = nn.Linear(
            self.hidden_size, (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim, bias=config.bias
        )
        self.wo = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=config.bias)
        self.rotary_emb = InternLM2RotaryEmbedding(self.head_dim, self.max_position_embeddings, config.rope_theta)

    def forward(self, hidden_states, attention_mask, position_ids, cache=None):
        bsz, q_len, _ = hidden_states.shape
        groups, d = self.num_key_value_groups, self.head_dim
        qkv = self.wqkv(hidden_states).view(bsz, q_len, -1, groups + 2, d)  # local KV heads from the shape
        q = qkv[..., :groups, :].reshape(bsz, q_len, -1, d).transpose(1, 2)
        k = qkv[..., -2, :].transpose(1, 2)
        v = qkv[..., -1, :].transpose(1, 2)

        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        cos, sin = self.rotary_emb(v, seq_len=past + q_len)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)

        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d)
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.wo(out)


class InternLM2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.attention = InternLM2Attention(config, layer_idx)
        self.feed_forward = InternLM2MLP(config)
        self.attention_norm = InternLM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn_norm = InternLM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, cache=None):
        hidden_states = hidden_states + self.attention(
            self.attention_norm(hidden_states), attention_mask, position_ids, cache
        )
        return hidden_states + self.feed_forward(self.ffn_norm(hidden_states))


class InternLM2PreTrainedModel(PreTrainedModel):
    config_class = InternLM2Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["InternLM2DecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, InternLM2RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, InternLM2RotaryEmbedding):
            module.reset_buffers()


def causal_mask(attention_mask, q_len, past, device):
    """Boolean [bs or 1, 1, q_len, past + q_len]: True where a query may attend."""
    kv_len = past + q_len
    query_pos = torch.arange(q_len, device=device)[:, None] + past
    allowed = (torch.arange(kv_len, device=device)[None, :] <= query_pos)[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, -kv_len:].to(device=device, dtype=torch.bool)
    return allowed


class InternLM2Model(InternLM2PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([InternLM2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = InternLM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.tok_embeddings

    def set_input_embeddings(self, value):
        self.tok_embeddings = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        cache=None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.tok_embeddings(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache()
        bsz, q_len = inputs_embeds.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(q_len, device=inputs_embeds.device) + past).unsqueeze(0).expand(bsz, -1)
        mask = causal_mask(attention_mask, q_len, past, inputs_embeds.device)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_ids, cache if use_cache else None)
        return BaseModelOutputWithPast(
            last_hidden_state=self.norm(hidden_states), **{CACHE_FIELD: cache if use_cache else None}
        )


class InternLM2ForCausalLM(InternLM2PreTrainedModel, GenerationMixin):
    _tp_plan = {"output": "colwise_gather_output"}

    def __init__(self, config):
        super().__init__(config)
        self.model = InternLM2Model(config)
        self.vocab_size = config.vocab_size
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def set_input_embeddings(self, value):
        self.model.tok_embeddings = value

    def get_output_embeddings(self):
        return self.output

    def set_output_embeddings(self, new_embeddings):
        self.output = new_embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cache=cache if cache is not None else past_key_values,
        )
        hidden_states = out.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:, :]
        logits = self.output(hidden_states).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: getattr(out, CACHE_FIELD)})
