"""The demo for tests/e2e/test_docs_examples.py: ``bootstrap_demo`` as `make up` runs it, with the
demo's trainers replaced by untrained models of the same architecture and signature (training
them takes about a minute here; the docs' examples need their interfaces, not their skill).

Run inside the platform's Django (``manage.py shell``): ``seed(files)`` also leaves in ``files``
what the examples take as the reader's own files: an ONNX model of the demo's shape
(fraud.onnx), a small classifier of 4 features (classifier.onnx, what the CLI's examples send),
a small embedder and MiniLM's tokenizer (embedder.onnx, tokenizer.json) and the Hugging Face
model directory docs/llm.md packs (my-model/).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from django.core.management import call_command
from onnx import TensorProto, helper, numpy_helper

from platform_site.demo import fraud, llama_storyteller, minilm, storyteller
from platform_site.management.commands import bootstrap_demo
from serving_agent.hf_archive import pack
from serving_agent.textgen import TextGenModel, to_safetensors


def mlp(inputs: str, sizes: list[int], outputs: str, seed: int = 0) -> bytes:
    """An ONNX MLP with random weights and a dynamic batch: ReLU between layers, softmax last."""
    rng = np.random.default_rng(seed)
    nodes, weights, last = [], [], inputs
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        w = (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32)
        weights += [
            numpy_helper.from_array(w, f"w{i}"),
            numpy_helper.from_array(np.zeros(b, np.float32), f"b{i}"),
        ]
        nodes.append(helper.make_node("Gemm", [last, f"w{i}", f"b{i}"], [f"h{i}"]))
        last = f"h{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [last], [f"r{i}"]))
            last = f"r{i}"
    nodes.append(helper.make_node("Softmax", [last], [outputs], axis=1))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info(inputs, TensorProto.FLOAT, ["batch", sizes[0]])],
        [helper.make_tensor_value_info(outputs, TensorProto.FLOAT, ["batch", sizes[-1]])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def embedder(vocab: int, width: int = 16) -> bytes:
    """A sentence embedder of the shape a tokenizer's version takes: token ids and their mask
    in, the mean of the tokens' random embeddings out."""
    rng = np.random.default_rng(2)
    table = rng.normal(size=(vocab, width)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["tokens"]),
        helper.make_node("ReduceMean", ["tokens", "axis"], ["sentence_embedding"], keepdims=0),
    ]
    ids = ["batch", "sequence"]
    graph = helper.make_graph(
        nodes,
        "embedder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ids)],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", width])],
        [
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(np.array([1], np.int64), "axis"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def letters_model() -> TextGenModel:
    """The storyteller's architecture, untrained, with a head that writes lowercase letters and
    spaces, as the trained demo writes text. Random weights would write any byte, mostly
    invalid UTF-8: the agent then does not send the last tokens of a stream that ends inside a
    character, and docs/generation-streaming.md's count of tokens fails."""
    import torch

    model = TextGenModel(storyteller.CONFIG)
    allowed = list(b" abcdefghijklmnopqrstuvwxyz")
    with torch.no_grad():
        # The final norm gives a constant vector; each byte's logit is its head row's sum.
        model.ln_f.weight.zero_()
        model.ln_f.bias.fill_(1.0)
        model.head.weight.fill_(-0.5)
        model.head.weight[allowed] = torch.rand(len(allowed), model.config.n_embd) * 0.1
    return model


# llama_storyteller.llama()'s config, as save_pretrained writes it: the files are written here
# without transformers, whose import alone takes seconds (the agent that serves it pays it).
LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "dtype": "float32",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": llama_storyteller.CONTEXT,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def llama_dir(directory: Path) -> Path:
    """What llama_storyteller.save_model_dir writes for an untrained llama(): config, random
    weights (safetensors), the BPE tokenizer and its config with the chat template."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True)
    text = llama_storyteller.CORPUS.read_text()
    paragraphs = [p for p in text.split("\n\n") if p.strip()][:200]
    tokenizer = llama_storyteller.train_tokenizer(paragraphs, vocab_size=LLAMA["vocab_size"])
    config = dict(LLAMA, vocab_size=tokenizer.get_vocab_size())
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    mlp_width = config["intermediate_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (hidden, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, hidden),
            f"{layer}.mlp.gate_proj.weight": (mlp_width, hidden),
            f"{layer}.mlp.up_proj.weight": (mlp_width, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, mlp_width),
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
        }
    rng = np.random.default_rng(3)
    weights = {
        name: np.ones(shape, np.float32)
        if len(shape) == 1
        else (rng.normal(size=shape) * 0.02).astype(np.float32)
        for name, shape in shapes.items()
    }
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    tokenizer_config = special | {"chat_template": llama_storyteller.CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return directory


def seed(files: Path) -> None:
    fraud_onnx = mlp("features", [fraud.N_FEATURES, 256, 256, 2], "probabilities")
    (files / "fraud.onnx").write_bytes(fraud_onnx)
    (files / "classifier.onnx").write_bytes(mlp("x", [4, 8, 2], "y", seed=1))
    tokenizer = minilm.tokenizer_path().read_text()
    (files / "tokenizer.json").write_text(tokenizer)
    vocab = len(json.loads(tokenizer)["model"]["vocab"])
    (files / "embedder.onnx").write_bytes(embedder(vocab))

    def fraud_model(**_: Any) -> tuple[bytes, dict[str, Any]]:
        return fraud_onnx, {"offline_metrics": {"accuracy": 0.5}}

    def text_model(seconds: float, **_: Any) -> tuple[bytes, dict[str, Any]]:
        return to_safetensors(letters_model()), {"description": "untrained"}

    def llama_model(seconds: float, **_: Any) -> tuple[bytes, dict[str, Any]]:
        return pack(llama_dir(files / "my-model")), {"description": "untrained"}

    # bootstrap_demo imports the generators' trainers when it calls them, the fraud one at the
    # top of its module.
    bootstrap_demo.train_fraud_model = fraud_model  # type: ignore[attr-defined,assignment]
    storyteller.train_text_model = text_model  # type: ignore[assignment]
    llama_storyteller.train_llama_storyteller = llama_model  # type: ignore[assignment]
    call_command("bootstrap_demo")
