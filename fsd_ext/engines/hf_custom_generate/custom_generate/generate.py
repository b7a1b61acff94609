"""FSD as a transformers custom_generate folder: model.generate(..., custom_generate=<this folder's
parent>, trust_remote_code=True, assistant_model=draft). The code lives in the installed fsd-ext
package (fsd_ext.hf); this file only hands transformers' raw generate arguments to it."""

from fsd_ext.hf import generate_from_raw_arguments


def generate(model, *args, **kwargs):
    return generate_from_raw_arguments(model, *args, **kwargs)
