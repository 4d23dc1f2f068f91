"""llm: the ONNX decoder on onnxruntime with a KV cache. Each batch that Triton's dynamic batcher forms runs to
completion together; a sequence that finishes leaves the batch at once."""

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backend.engine import generate
from python_backend.llm_requests import sequence_from_inputs
from python_backend.model_files import ONNX_FILE, ModelSettings, resolve_model_dir
from python_backend.onnx_decoder import OnnxDecoder
from python_backend.triton_glue import error_response, getter, parameters


class TritonPythonModel:
    def initialize(self, args):
        params = parameters(args)
        model_dir = resolve_model_dir(params["model_dir"], args["model_repository"])
        self.settings = ModelSettings.load(model_dir)
        self.max_context = min(int(params["max_context_length"]), self.settings.max_position_embeddings)
        self.decoder = OnnxDecoder(model_dir / ONNX_FILE, intra_op_threads=int(params["intra_op_threads"]))

    def execute(self, requests):
        responses = [None] * len(requests)
        sequences, rows = [], []
        for row, request in enumerate(requests):
            try:
                sequences.append(
                    sequence_from_inputs(getter(pb_utils, request), self.settings.eos_token_ids, self.max_context)
                )
                rows.append(row)
            except Exception as error:
                responses[row] = error_response(pb_utils, error)
        if sequences:
            try:
                generate(self.decoder, sequences)
            except Exception as error:
                for row in rows:
                    responses[row] = error_response(pb_utils, error)
                return responses
        for row, seq in zip(rows, sequences):
            ids = pb_utils.Tensor("output_ids", np.asarray([seq.output_ids], np.int32))
            responses[row] = pb_utils.InferenceResponse(output_tensors=[ids])
        return responses
