"""InternLM2 causal LM (dsexp's own implementation of the published architecture, written to behave like the
remote code internlm2-chat-20b ships, traps included).

Layout and names follow InternLM2 checkpoints: `model.tok_embeddings`, `model.layers.N.attention.wqkv`
(rows grouped per key/value head: [q x groups, k, v] for each KV head), `attention.wo`,
`feed_forward.w1/w3/w2` (SwiGLU), `attention_norm`, `ffn_norm`, `model.norm`, `output`.

Like the published code, and on purpose (dsexp must work for code as its authors publish it):
- every attention layer owns a rotary module whose `inv_freq` and cos/sin tables (all positions up to
  `max_position_embeddings`) are non-persistent buffers computed in `__init__` only; nothing recomputes them
  later, so a loader that leaves them uninitialised (transformers >= 5 builds models on the meta device) gives
  NaN or wrong logits;
- the attention reshapes its output with `self.hidden_size` and checks sizes with `self.num_heads`: DeepSpeed's
  AutoTP divides those attributes on the module, transformers' tensor parallelism does not;
- there is no tensor-parallel plan;
- the cache is the legacy one: a tuple of (key, value) per layer. A `transformers.Cache` that generate hands over
  is accepted too, so the same file generates on transformers 4.42 (the seed's) and 5.x.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

# A relative import only: transformers' remote-code loader treats any other import as a package to install.
from .configuration_internlm2 import InternLM2Config

# Name of the key/value cache in model outputs for the installed transformers (5.2x renamed it `cache`).
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
    """inv_freq (fp32) and the cos/sin tables (the default dtype at construction), computed once, here."""

    def __init__(self, dim, max_position_embeddings=2048, base=10000.0):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        self.register_buffer("inv_freq", 1.0 / (base**exponents), persistent=False)
        self._cache_tables(max_position_embeddings, torch.get_default_dtype())

    def _cache_tables(self, seq_len, dtype):
        self.max_seq_len_cached = seq_len
        positions = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq.float())
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos_cached", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cached", angles.sin().to(dtype), persistent=False)

    def forward(self, x, seq_len):
        if seq_len > self.max_seq_len_cached:  # beyond the tables: grow them from the stored inv_freq
            self._cache_tables(seq_len, x.dtype)
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


def _past_length(past, layer_idx=0):
    """Tokens already in a legacy (tuple) or Cache past; 0 without one."""
    if past is None:
        return 0
    if hasattr(past, "get_seq_length"):
        return past.get_seq_length(layer_idx)
    return past[layer_idx][0].shape[-2] if len(past) > layer_idx else 0


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

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.shape
        groups, d = self.num_key_value_groups, self.head_dim
        qkv = self.wqkv(hidden_states).view(bsz, q_len, -1, groups + 2, d)  # KV heads inferred from the rows
        q = qkv[..., :groups, :].reshape(bsz, q_len, -1, d).transpose(1, 2)
        k = qkv[..., -2, :].transpose(1, 2)
        v = qkv[..., -1, :].transpose(1, 2)

        cache = past_key_value if hasattr(past_key_value, "update") else None
        past = cache.get_seq_length(self.layer_idx) if cache is not None else _legacy_len(past_key_value)
        cos, sin = self.rotary_emb(v, seq_len=past + q_len)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        elif past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        present = (k, v) if use_cache and cache is None else None
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)

        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d)
        if scores.size() != (bsz, self.num_heads, q_len, k.shape[2]):
            raise ValueError(
                f"attention weights should be of size {(bsz, self.num_heads, q_len, k.shape[2])}, "
                f"but are {tuple(scores.size())}"
            )
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.wo(out), present


def _legacy_len(past_key_value):
    return past_key_value[0].shape[-2] if past_key_value is not None else 0


class InternLM2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.attention = InternLM2Attention(config, layer_idx)
        self.feed_forward = InternLM2MLP(config)
        self.attention_norm = InternLM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn_norm = InternLM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False):
        attn, present = self.attention(
            self.attention_norm(hidden_states), attention_mask, position_ids, past_key_value, use_cache
        )
        hidden_states = hidden_states + attn
        return hidden_states + self.feed_forward(self.ffn_norm(hidden_states)), present


class InternLM2PreTrainedModel(PreTrainedModel):
    config_class = InternLM2Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["InternLM2DecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()


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
        past_key_values = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.tok_embeddings(input_ids)
        bsz, q_len = inputs_embeds.shape[:2]
        past = _past_length(past_key_values)
        if position_ids is None:
            position_ids = (torch.arange(q_len, device=inputs_embeds.device) + past).unsqueeze(0).expand(bsz, -1)
        mask = causal_mask(attention_mask, q_len, past, inputs_embeds.device)
        legacy = not hasattr(past_key_values, "update")
        hidden_states, presents = inputs_embeds, []
        for i, layer in enumerate(self.layers):
            layer_past = past_key_values if not legacy else (past_key_values[i] if past_key_values else None)
            hidden_states, present = layer(hidden_states, mask, position_ids, layer_past, use_cache)
            presents.append(present)
        next_cache = (tuple(presents) if legacy else past_key_values) if use_cache else None
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **{CACHE_FIELD: next_cache})


class InternLM2ForCausalLM(InternLM2PreTrainedModel, GenerationMixin):
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
            past_key_values=cache if cache is not None else past_key_values,
        )
        hidden_states = out.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:, :]
        logits = self.output(hidden_states).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: getattr(out, CACHE_FIELD)})

    def prepare_inputs_for_generation(
        self, input_ids, past_key_values=None, attention_mask=None, inputs_embeds=None, cache=None, **kwargs
    ):
        """The legacy-cache generation step: feed only the tokens the past does not hold, positions from the mask."""
        past_key_values = cache if cache is not None else past_key_values
        past = _past_length(past_key_values)
        if past:
            input_ids = input_ids[:, past:] if input_ids.shape[1] > past else input_ids[:, -1:]
        position_ids = kwargs.get("position_ids")
        if attention_mask is not None and position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if position_ids is not None:
            position_ids = position_ids[:, -input_ids.shape[1] :]
        inputs = {"input_ids": input_ids} if inputs_embeds is None or past else {"inputs_embeds": inputs_embeds}
        return {
            **inputs,
            "past_key_values": past_key_values,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "use_cache": kwargs.get("use_cache", True),
        }

    @torch.no_grad()
    def chat(
        self,
        tokenizer,
        query,
        history=(),
        streamer=None,
        max_new_tokens=1024,
        do_sample=True,
        temperature=0.8,
        top_p=0.8,
        meta_instruction="You are an AI assistant.",
        **kwargs,
    ):
        """A chat turn as the published InternLM2 chat models offer it: the conversation in the ChatML layout
        (<|im_start|>role ... <|im_end|>), generate, and the new text back with the history extended."""
        turns = [("system", meta_instruction)] if meta_instruction else []
        for user, assistant in history:
            turns += [("user", user), ("assistant", assistant)]
        turns.append(("user", query))
        prompt = "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)
        inputs = tokenizer([prompt + "<|im_start|>assistant\n"], return_tensors="pt")
        inputs = {k: inputs[k].to(self.device) for k in ("input_ids", "attention_mask") if k in inputs}
        out = self.generate(
            **inputs,
            streamer=streamer,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_p=top_p,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            **kwargs,
        )
        response = tokenizer.decode(out[0][inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        return response, [*history, (query, response)]
