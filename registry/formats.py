"""The model formats the platform takes: one entry per format, as KServe's model servers each
implement one ``Model``. An entry says how an upload of that format is checked and what its
signature is, what OIP metadata calls the runtime that serves it, and everything else the
platform does differently for it. Code elsewhere asks this table, never compares format names.

The agent has the other half (``serving_agent.formats``: how a format is loaded and run);
``tests/test_formats.py`` checks that both tables hold the same formats (but a composed one,
a graph, which runs on the gateway and which no agent loads). Adding a format is one
entry here, one there, and their tests (``docs/runtimes.md``, "Adding a model format").
"""

from __future__ import annotations

import io
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.core.files.base import File

from serving_agent.package import Package, PackageError, read_member, read_package
from serving_agent.torch_archive import ArchiveError, read_archive

from .graph_spec import Lookup, check_document, compose_upload
from .hf_artifact import check_hf_archive, hf_weights
from .signature import SignatureError, read_onnx_signature, read_onnx_signature_from_file
from .uploads import contents, on_disk
from .weights import (
    Tensor,
    Weights,
    non_finite,
    onnx_weights,
    safetensors_weights,
    torch_weights,
)

# A version's inputs and outputs, as stored on ModelVersion: [{"name", "datatype", "shape"}].
Signature = tuple[list[dict[str, Any]], list[dict[str, Any]]]

# What a text-generation version takes and gives, in OIP terms (the signature is fixed by the
# architecture; streams speak the generation protocol, not tensors).
TEXTGEN_INPUTS = [{"name": "prompt", "datatype": "BYTES", "shape": [-1]}]
TEXTGEN_OUTPUTS = [{"name": "text", "datatype": "BYTES", "shape": [-1]}]


@dataclass(frozen=True)
class Format:
    """Everything the platform knows about one artifact format."""

    value: str  # stored in ModelVersion.format and sent to agents: the key of both tables
    label: str  # what people read (the admin, the upload form)
    # OIP model metadata's ``platform``, in KServe's and Triton's words: the runtime that
    # really serves the version.
    platform: str
    # Refuses an artifact that is not of this format (SignatureError naming the problem) and
    # reads its signature, without running anything from it. It also refuses NaN or infinite
    # weights: an iterator of registry.weights reads them, ``refuse_non_finite`` judges them
    # (ONNX's check does both in registry.onnx_check.load_checked).
    check: Callable[[File[bytes]], Signature]
    extension: str  # of the stored artifact's name
    # Streams tokens (websocket, OpenAI API) instead of answering tensors.
    generates_text: bool = False
    # The agent tokenizes prompts and renders chats with the model's own tokenizer and template;
    # otherwise the gateway counts the prompt's tokens (bytes) and writes chats as plain turns.
    tokenizes_on_agent: bool = False
    takes_tokenizer: bool = False  # a tokenizer.json may be attached, making it take text
    quantizable: bool = False  # registry.quantize can make an INT8 variant of it
    # The artifact names its own features (a python package's manifest): the version's
    # feature names when the upload declares none.
    features: Callable[[File[bytes]], list[str]] | None = None
    # Composed of other versions of the same tenant (a graph, docs/graphs.md) and run by the
    # gateway, which sends each of them to the agents like any request: no agent loads such a
    # version, so the agent's table has no entry for it. ``check`` then reads the document
    # alone; ``compose`` checks it against the versions it names (the lookup, tenant-scoped)
    # and gives the signature, derived from them, and what the version keeps in ``lineage``.
    compose: Callable[[File[bytes], Lookup], tuple[Signature, dict[str, Any]]] | None = None

    @property
    def runs_on_agent(self) -> bool:
        """An agent loads and runs versions of this format (every format but a composed one)."""
        return self.compose is None


def _check_onnx(upload: File[bytes]) -> Signature:
    """An upload on disk is checked in a child process (ONNX's checker loads the weights);
    one in memory (at most ``FILE_UPLOAD_MAX_MEMORY_SIZE``, or bytes a caller already holds)
    here."""
    path = on_disk(upload)
    if path is not None:
        return read_onnx_signature_from_file(path)
    upload.seek(0)
    return read_onnx_signature(upload.read())


def _check_textgen(upload: File[bytes]) -> Signature:
    from serving_agent.textgen import read_config  # torch: imported only for such uploads

    try:
        with contents(upload) as data:
            read_config(data)  # reads the header, and only the size of the rest
    except ValueError as exc:
        raise SignatureError("artifact", f"not a valid text-generation artifact: {exc}") from None
    upload.seek(0)
    refuse_non_finite(safetensors_weights(upload))
    return TEXTGEN_INPUTS, TEXTGEN_OUTPUTS


def _check_hf(upload: File[bytes]) -> Signature:
    upload.seek(0)
    check_hf_archive(on_disk(upload) or upload)
    upload.seek(0)
    refuse_non_finite(hf_weights(on_disk(upload) or upload))
    return TEXTGEN_INPUTS, TEXTGEN_OUTPUTS


def _check_torch(upload: File[bytes]) -> Signature:
    """A torch.export archive's signature, read from its JSON: nothing in it runs here."""
    path = on_disk(upload)
    try:
        if path is not None:
            archive = read_archive(path)
        else:
            upload.seek(0)
            archive = read_archive(io.BytesIO(upload.read()))
    except ArchiveError as exc:
        raise SignatureError("artifact", f"not a valid torch.export archive: {exc}") from None
    upload.seek(0)
    refuse_non_finite(torch_weights(path or upload, archive.root))
    return archive.inputs, archive.outputs


def _read_package(upload: File[bytes]) -> Package:
    path = on_disk(upload)
    upload.seek(0)
    try:
        return read_package(Path(path) if path is not None else upload)
    except PackageError as exc:
        raise SignatureError(exc.field, exc.message) from None


def _check_python(upload: File[bytes]) -> Signature:
    """A python package (``serving_agent.package``): its layout, manifest and pinned
    requirements are checked, nothing in it runs here (its code runs only in an agent's
    sandboxed worker); the signature is the manifest's. Weights it holds in a format the
    registry reads (``.onnx``, ``.safetensors``) are judged like an upload of that format;
    others are the package's own business."""
    package = _read_package(upload)
    if package.manifest.generates:
        raise SignatureError(
            "model.generates",
            "this package generates text (generates = true): upload it with "
            "format=python_generator",
        )
    refuse_non_finite(_package_weights(upload, package))
    manifest = package.manifest
    return [t.as_dict() for t in manifest.inputs], [t.as_dict() for t in manifest.outputs]


def _check_python_generator(upload: File[bytes]) -> Signature:
    """A python package whose class streams text (``generate``, docs/custom-code.md,
    "Streaming text"): checked as ``_check_python`` checks, its manifest saying
    ``generates = true``; its signature is every generative version's."""
    package = _read_package(upload)
    if not package.manifest.generates:
        raise SignatureError(
            "model.generates",
            "a python_generator package says generates = true in its [model] table (a package "
            "answering batches is format=python)",
        )
    refuse_non_finite(_package_weights(upload, package))
    return TEXTGEN_INPUTS, TEXTGEN_OUTPUTS


def _package_weights(upload: File[bytes], package: Package) -> Weights:
    import onnx  # only for packages holding a graph

    path = on_disk(upload)
    for member in package.members:
        if not member.name.endswith((".onnx", ".safetensors")):
            continue
        upload.seek(0)
        source = Path(path) if path is not None else upload
        data = read_member(source, package, member.name, member.size)
        if member.name.endswith(".onnx"):
            try:
                weights = onnx_weights(onnx.load_model_from_string(data))
            except Exception as exc:  # noqa: BLE001 - protobuf's errors have no common base
                raise SignatureError(member.name, f"not a readable ONNX graph: {exc}") from None
        else:
            weights = safetensors_weights(io.BytesIO(data))
        for tensor in weights:
            yield Tensor(f"{member.name}:{tensor.name}", tensor.size, tensor.pieces)


def _python_features(upload: File[bytes]) -> list[str]:
    return list(_read_package(upload).manifest.features)


def refuse_non_finite(weights: Weights) -> None:
    """Refuse an artifact with a NaN or infinite weight (``registry.weights``), naming it."""
    try:
        problem = non_finite(weights)
    # A payload the format's check let through but that cannot be read to its end.
    except (ValueError, KeyError, EOFError, OSError, zipfile.BadZipFile, zlib.error) as exc:
        raise SignatureError("artifact", f"the weights cannot be read: {exc}") from None
    if problem is not None:
        raise SignatureError("artifact", problem)


FORMATS: dict[str, Format] = {
    f.value: f
    for f in (
        # An ONNX graph, run by ONNX Runtime. Classic ML (scikit-learn, XGBoost, LightGBM) is
        # uploaded converted to ONNX (skl2onnx, onnxmltools), so it is this format too.
        Format(
            "onnx",
            "ONNX",
            platform="onnxruntime_onnx",
            check=_check_onnx,
            extension="onnx",
            takes_tokenizer=True,
            quantizable=True,
        ),
        # Safetensors weights of the known decoder-only architecture (serving_agent.textgen):
        # no pickle, so loading a tenant's upload runs no code. Served by Switchyard's own
        # generation engine, which no other server names.
        Format(
            "textgen",
            "Text generation (safetensors)",
            platform="switchyard_textgen",
            check=_check_textgen,
            extension="safetensors",
            generates_text=True,
        ),
        # A Hugging Face causal LM as one archive: config.json of a supported architecture,
        # *.safetensors weights and tokenizer.json; refused at upload if anything needs pickle
        # or remote code. The agent runs it with transformers. The archive may be a tar, a
        # gzipped tar or a zip (the agent looks at its first bytes), so no usual extension fits.
        Format(
            "hf",
            "Hugging Face causal LM (archive)",
            platform="huggingface_transformers",
            check=_check_hf,
            extension="hf",
            generates_text=True,
            tokenizes_on_agent=True,
        ),
        # A torch model exported without arbitrary unpickling (torch.export archive), run as
        # the exported program in Python torch: Triton's "pytorch_libtorch" names TorchScript
        # run by libtorch, which is refused here.
        Format(
            "torch",
            "torch (exported program)",
            platform="pytorch",
            check=_check_torch,
            extension="pt2",
        ),
        # A team's own code (docs/custom-code.md): a package with a class whose load/predict
        # (or preprocess/predict/postprocess) the agent runs in a sandboxed worker process, in
        # an environment built from the package's pinned requirements. Stored as uploaded (a
        # zip or a tar, compressed or not).
        Format(
            "python",
            "Python package (your own code)",
            platform="switchyard_python",
            check=_check_python,
            extension="pypkg",
            features=_python_features,
        ),
        # The same, for a package whose class streams text: its ``generate`` yields strings,
        # one token each, over the websocket and the OpenAI routes like the built-in
        # generators. The prompt's tokens are counted by the gateway (UTF-8 bytes).
        Format(
            "python_generator",
            "Python package generating text (your own code)",
            platform="switchyard_python",
            check=_check_python_generator,
            extension="pypkg",
            generates_text=True,
        ),
        # Other versions of the same tenant composed as a sequence, an ensemble or a switch: a
        # JSON document (docs/graphs.md), run on the gateway node by node, each node dispatched
        # like any request. It names its nodes by model and version or alias, so it is checked
        # against the registry at upload (``compose``), never loaded by an agent.
        Format(
            "graph",
            "Inference graph (JSON)",
            platform="switchyard_graph",
            check=check_document,
            extension="json",
            compose=compose_upload,
        ),
    )
}
# What an upload is when it does not say.
DEFAULT_FORMAT = "onnx"


def format_choices() -> list[tuple[str, str]]:
    """``ModelVersion.format``'s choices. A callable, so that a new format changes no migration
    (Django stores a reference to it, not the list)."""
    return [(f.value, f.label) for f in FORMATS.values()]


def format_of(value: str) -> Format:
    """The table's entry for a format value; an unknown one is refused like a bad field."""
    try:
        return FORMATS[value]
    except KeyError:
        raise SignatureError("format", f"must be one of {sorted(FORMATS)}") from None


def labels_where(wanted: Callable[[Format], bool]) -> str:
    """The labels of the formats with a property, for messages ("ONNX", "ONNX or torch")."""
    return " or ".join(f.label for f in FORMATS.values() if wanted(f))
