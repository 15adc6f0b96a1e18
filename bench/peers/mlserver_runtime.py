"""An MLServer custom runtime serving an ONNX file with ONNX Runtime: the optional third peer row
of ``bench/oip_bench.py --peers mlserver``.

It runs in ``bench/.mlserver-venv`` (MLServer's pins conflict with KServe's); ``peers_bench.py``
copies it and ``peer_oip.py`` beside the model's ``model-settings.json``. MLServer speaks OIP v2
natively, so the benchmark sends it the same body as Switchyard. No adaptive batching (its
default): each request is one ONNX Runtime call, as in KServe's row.
"""

from __future__ import annotations

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import InferenceError
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument
from peer_oip import onnx_session


class OnnxRuntimeModel(MLModel):
    """One ONNX file, one ONNX Runtime session (one intra-op thread, as Switchyard's agent)."""

    async def load(self) -> bool:
        self.session = onnx_session(await get_model_uri(self._settings))
        self.output_names = [o.name for o in self.session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        try:
            feed = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
            arrays = self.session.run(self.output_names, feed)
        except (InvalidArgument, Fail, ValueError) as exc:  # names, shapes or dtypes: a 400
            raise InferenceError(str(exc)) from exc
        return InferenceResponse(
            model_name=self.name,
            id=payload.id,
            outputs=[
                NumpyCodec.encode_output(n, a)
                for n, a in zip(self.output_names, arrays, strict=True)
            ],
        )
