"""The ``hf`` archive check: what a Hugging Face model archive must hold, and every way one
that would run code or write outside its directory is refused."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
import zipfile
from pathlib import Path

import pytest

from serving_agent.hf_archive import check_archive, extract, pack
from tests.hf_models import save_model_dir, tiny_model, train_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = train_tokenizer()
    model = tiny_model("llama", tokenizer.get_vocab_size())
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("hf") / "model")


def files_of(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.is_file()}


def tar_of(files: dict[str, bytes], prefix: str = "") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def zip_of(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buffer.getvalue()


def refused(data: bytes, match: str, max_total: int = 1 << 30) -> None:
    with pytest.raises(ValueError, match=match):
        check_archive(io.BytesIO(data), max_total=max_total)


def test_a_saved_model_directory_packs_into_an_accepted_archive(model_dir: Path) -> None:
    manifest = check_archive(io.BytesIO(pack(model_dir)))
    assert manifest.model_type == "llama"
    assert manifest.weights == ["model.safetensors"]
    assert manifest.parameters > 0
    assert "chat_template" in manifest.tokenizer_config


def test_zip_and_one_top_directory_are_accepted(model_dir: Path) -> None:
    assert check_archive(io.BytesIO(zip_of(files_of(model_dir)))).model_type == "llama"
    assert check_archive(io.BytesIO(tar_of(files_of(model_dir), "my-model/"))).weights


def test_extract_writes_only_the_files_the_agent_loads(model_dir: Path, tmp_path: Path) -> None:
    files = files_of(model_dir) | {"README.md": b"# a model"}
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(tar_of(files))
    extract(archive, tmp_path / "out")
    written = {p.name for p in (tmp_path / "out").iterdir()}
    assert written == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        ".complete",
    }


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "optimizer.pkl", "x.ckpt"])
def test_pickle_formats_are_refused_by_name(model_dir: Path, name: str) -> None:
    refused(tar_of(files_of(model_dir) | {name: b"anything"}), "pickle format")


def test_a_pickle_under_another_name_is_refused_by_its_bytes(model_dir: Path) -> None:
    payload = pickle.dumps({"weights": [1, 2, 3]}, protocol=4)
    refused(tar_of(files_of(model_dir) | {"weights.dat": payload}), "is a pickle")
    refused(tar_of(files_of(model_dir) | {"model.safetensors": payload}), "is a pickle")


def test_a_torch_checkpoint_hidden_as_a_nested_archive_is_refused(model_dir: Path) -> None:
    nested = zip_of({"archive/data.pkl": pickle.dumps(1)})
    refused(tar_of(files_of(model_dir) | {"extra.safetensors": nested}), "nested archive")


def test_remote_code_is_refused(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    auto = config | {"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    files = files_of(model_dir)
    refused(tar_of(files | {"config.json": json.dumps(auto).encode()}), "remote code")
    refused(tar_of(files | {"modeling_x.py": b"import os"}), "is code")
    unknown = json.dumps(config | {"model_type": "x", "architectures": ["X"]}).encode()
    refused(tar_of(files | {"config.json": unknown}), "model_type 'x' is not supported")


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("../evil.json", "leaves the model directory"),
        ("a/../../evil.json", "leaves the model directory"),
        ("/etc/evil.json", "absolute path"),
        ("C:/evil.json", "absolute path"),
        ("a\\evil.json", "backslashes"),
    ],
)
def test_paths_leaving_the_directory_are_refused(model_dir: Path, name: str, match: str) -> None:
    refused(tar_of(files_of(model_dir) | {name: b"{}"}), match)


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE])
def test_links_and_devices_are_refused(model_dir: Path, kind: bytes) -> None:
    buffer = io.BytesIO(tar_of(files_of(model_dir)))
    data = io.BytesIO()
    with tarfile.open(fileobj=buffer) as src, tarfile.open(fileobj=data, mode="w") as tar:
        for member in src:
            tar.addfile(member, src.extractfile(member))
        link = tarfile.TarInfo("tokenizer_extra.json")
        link.type, link.linkname = kind, "/etc/passwd"
        tar.addfile(link)
    refused(data.getvalue(), "only regular files")


def test_zip_bombs_are_refused_by_their_expanded_size_and_member_count(model_dir: Path) -> None:
    files = files_of(model_dir)
    refused(zip_of(files | {"zeros.txt": bytes(50_000_000)}), "expands past", max_total=10**7)
    many = {f"f{i}.txt": b"" for i in range(70)}
    refused(tar_of(files | many), "more than 64 files")


def test_missing_parts_and_bad_weights_are_named(model_dir: Path) -> None:
    files = files_of(model_dir)
    refused(tar_of({k: v for k, v in files.items() if k != "tokenizer.json"}), "no tokenizer")
    refused(tar_of({k: v for k, v in files.items() if k != "model.safetensors"}), "safetensors")
    refused(tar_of(files | {"tokenizer.json": b'{"version": 1}'}), "tokenizer.json does not load")
    refused(tar_of(files | {"model.safetensors": b"\xff" * 64}), "not a safetensors file")
    template = {"chat_template": "{% for %}"}
    bad = json.dumps(template).encode()
    refused(tar_of(files | {"tokenizer_config.json": bad}), "chat template does not compile")
    refused(b"not an archive at all", "not a tar, tar.gz or zip")


def test_a_gzip_bomb_in_a_tar_is_refused_before_it_is_expanded(model_dir: Path) -> None:
    """A member declaring terabytes, or a PAX header tarfile would read into memory whole:
    refused from the headers, without decompressing the data."""
    import gzip

    header = tarfile.TarInfo("zeros.txt")
    header.size = 10**12
    bomb = gzip.compress(header.tobuf() + bytes(1024 * 1024))
    refused(bomb, "expands past")

    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type, pax.size = tarfile.XHDTYPE, 512 * 1024 * 1024
    refused(gzip.compress(pax.tobuf() + bytes(1024)), "oversized metadata header")


def test_sharded_weights_load_through_their_index(tmp_path: Path) -> None:
    """A model saved in several *.safetensors shards loads (the index is extracted with them),
    and an index naming a shard the archive lacks is refused."""
    from serving_agent._hf import HFDecoder, load_model

    tokenizer = train_tokenizer()
    model = tiny_model("gpt2", tokenizer.get_vocab_size())
    source = tmp_path / "model"
    save_model_dir(model, tokenizer, source)
    for shard in source.glob("*.safetensors"):
        shard.unlink()
    model.save_pretrained(source, max_shard_size="100KB")
    shards = sorted(p.name for p in source.glob("*.safetensors"))
    assert len(shards) > 1
    (tmp_path / "a.tar.gz").write_bytes(pack(source))
    assert check_archive(tmp_path / "a.tar.gz").weights == shards
    extract(tmp_path / "a.tar.gz", tmp_path / "x")
    HFDecoder(load_model(tmp_path / "x", "cpu"), tmp_path / "x", 32)

    files = files_of(source)
    del files[shards[0]]
    refused(tar_of(files), "names weight files the archive does not hold")
