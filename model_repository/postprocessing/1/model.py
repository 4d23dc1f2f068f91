"""postprocessing: token ids -> text (special tokens skipped; the prompt is never echoed)."""

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backend.model_files import resolve_model_dir
from python_backend.tokenization import PromptTokenizer
from python_backend.triton_glue import error_response, getter, parameters


class TritonPythonModel:
    def initialize(self, args):
        model_dir = resolve_model_dir(parameters(args)["model_dir"], args["model_repository"])
        self.tokenizer = PromptTokenizer(model_dir)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids = getter(pb_utils, request)("output_ids").reshape(-1).tolist()
                text = self.tokenizer.decode(ids)
            except Exception as error:
                responses.append(error_response(pb_utils, error))
                continue
            outputs = [
                pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
                pb_utils.Tensor("output_token_count", np.array([[len(ids)]], dtype=np.int32)),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
