"""Uploading an ``hf`` version: a real archive is accepted and handed to agents as a generative
version; one holding a pickle is refused naming it (the HTTP 400 is in tests/e2e/test_hf_e2e)."""

import io
import pickle
import tarfile

import pytest

from fleet.assignments import version_spec
from registry.services import TEXTGEN_INPUTS, create_version
from registry.signature import SignatureError
from tests.factories import make_model, make_tenant
from tests.hf_models import make_archive


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> bytes:
    return make_archive("gpt2", tmp_path_factory.mktemp("gpt2"))[0]


def test_an_archive_becomes_a_generative_version(db, archive):
    model = make_model(make_tenant("t"), "llm", task="generator")
    version = create_version(model, archive, format="hf", max_input_tokens=32)
    assert version.generates_text and version.inputs == TEXTGEN_INPUTS
    spec = version_spec(version)
    assert spec.format == "hf" and spec.generation is not None
    assert spec.generation.max_input_tokens == 32


def test_a_pickle_in_the_archive_is_refused(db, archive):
    model = make_model(make_tenant("t"), "llm", task="generator")
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(archive)) as src,
        tarfile.open(fileobj=out, mode="w:gz") as tar,
    ):
        for member in src:
            tar.addfile(member, src.extractfile(member))
        payload = pickle.dumps({"w": 1})
        info = tarfile.TarInfo("optimizer.state")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    with pytest.raises(SignatureError, match="optimizer.state is a pickle"):
        create_version(model, out.getvalue(), format="hf")
    assert not model.versions.exists()
