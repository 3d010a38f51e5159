#!/usr/bin/env python3
"""Tiny random-weight Hugging Face checkpoints, and what transformers computes with them, as
fixtures for tests/models.rs (which then needs no Python).

Writes, under tests/fixtures/hf/:
  llama_gqa/      Llama, 4 query heads over 2 key/value heads, untied head, F32 weights
  llama_tied_bf16/ Llama, 4 query heads over 1 key/value head, head tied to the embedding,
                  BF16 weights (the reference is the model upcast to F32, as wgrad loads it)
  gpt2/           GPT-2 (tied head), F32 weights, saved in shards with an index
each with config.json and the weights as save_pretrained writes them, and reference.safetensors:
  tokens [2, 8] (I64), targets [2, 8] (I64), logits [2, 8, V], loss [] (mean cross-entropy of
  the logits against the targets), "grad.<name>" for every parameter (transformers' names),
  mask [2, 8] (I64, the second row padded after 5 tokens) and masked_logits under that mask,
  prompt [1, 4] and greedy [1, 24] (prompt and 20 tokens of greedy generation, KV cache on).

`tools/hf_fixtures.py --check target/hf_saved` loads the checkpoints tests/models.rs saves
there with transformers and compares their logits with wgrad's.

Needs torch and transformers (pip install torch transformers safetensors).
"""

import json
import pathlib

import torch
import transformers
from safetensors.torch import save_file

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
VOCAB = 64


def llama(kv_heads, tied):
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def gpt2():
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def randomize(model):
    """Weights far from transformers' initialisation (std 0.02, norms at one), so that a wrong
    rotation, head order or norm shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln_" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def reference(model):
    """The tensors tests/models.rs compares against, from `model` in F32 and eval mode."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (2, 8), generator=gen)
    targets = torch.randint(0, VOCAB, (2, 8), generator=gen)
    logits = model(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    model.zero_grad()
    loss.backward()
    grads = {f"grad.{n}": p.grad.contiguous() for n, p in model.named_parameters()}
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        masked_logits = model(input_ids=tokens, attention_mask=mask).logits
        prompt = tokens[:1, :4]
        greedy = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
    return {
        "tokens": tokens,
        "targets": targets,
        "logits": logits.detach(),
        "loss": loss.detach(),
        "mask": mask,
        "masked_logits": masked_logits,
        "prompt": prompt.contiguous(),
        "greedy": greedy,
        **grads,
    }


def write(name, model, dtype=torch.float32, shard=None):
    out = ROOT / name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    saved = model.to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    saved.save_pretrained(out, safe_serialization=True, **kwargs)
    # What wgrad computes with: the saved checkpoint loaded in F32, as from_pretrained
    # loads it (buffers such as the rotary frequencies rebuilt in F32, not rounded to BF16).
    model = type(saved).from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    save_file({k: v.clone().contiguous() for k, v in reference(model).items()}, out / "reference.safetensors")
    print("wrote", out, sorted(p.name for p in out.iterdir()))


def main():
    print("transformers", transformers.__version__, "torch", torch.__version__)
    torch.manual_seed(0)
    attn = {"attn_implementation": "eager"}
    write("llama_gqa", randomize(transformers.LlamaForCausalLM._from_config(llama(2, False), **attn)))
    write(
        "llama_tied_bf16",
        randomize(transformers.LlamaForCausalLM._from_config(llama(1, True), **attn)),
        dtype=torch.bfloat16,
    )
    gpt = randomize(transformers.GPT2LMHeadModel._from_config(gpt2(), **attn))
    write("gpt2", gpt, shard="40KB")
    with open(ROOT / "VERSIONS.json", "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__}, f)


def check(root):
    """Loads every checkpoint wgrad saved under `root` (tests/models.rs writes
    target/hf_saved) with AutoModelForCausalLM and compares its logits with wgrad's."""
    from safetensors.torch import load_file

    for out in sorted(pathlib.Path(root).iterdir()):
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        model.eval()
        theirs = load_file(out / "wgrad_logits.safetensors")
        with torch.no_grad():
            logits = model(input_ids=theirs["tokens"].long()).logits
        worst = ((logits - theirs["logits"]).abs() / (1 + theirs["logits"].abs())).max().item()
        print(f"{out.name}: {type(model).__name__} loaded; logits differ from wgrad's by {worst:.2e}")
        assert worst <= 1e-4, out


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        check(sys.argv[2])
    else:
        main()
