//! What a GGUF file from outside must satisfy before candle reads more of it.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{self, Value};

/// Every tensor's size from its shape and type, with checked arithmetic, lies inside the file
/// (candle multiplies the dimensions and allocates that many bytes when a tensor is read: a
/// crafted shape would overflow or ask for terabytes).
pub(super) fn check_tensor_extents(
    content: &gguf_file::Content,
    file_len: u64,
) -> Result<(), String> {
    for (name, info) in &content.tensor_infos {
        let dims = info.shape.dims();
        let (block, type_size) = (info.ggml_dtype.block_size(), info.ggml_dtype.type_size());
        let bytes = dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|n| block > 0 && n % block == 0)
            .and_then(|n| (n / block).checked_mul(type_size));
        let end = bytes.and_then(|b| {
            content
                .tensor_data_offset
                .checked_add(info.offset)?
                .checked_add(u64::try_from(b).ok()?)
        });
        if dims.len() > 4 || end.is_none_or(|end| end > file_len) {
            return Err(format!(
                "tensor `{name}` ({dims:?} of {:?} at offset {}) does not fit a {file_len}-byte \
                 file",
                info.ggml_dtype, info.offset
            ));
        }
    }
    Ok(())
}

/// GGUF's `general.alignment`, when given: a non-zero multiple of 8 (the format's rule), or
/// why not.
pub(super) fn check_alignment(metadata: &HashMap<String, Value>) -> Result<(), String> {
    // The integer types candle reads it from (another type: candle uses its default).
    let alignment: Option<i64> = match metadata.get("general.alignment") {
        Some(Value::U8(v)) => Some((*v).into()),
        Some(Value::U16(v)) => Some((*v).into()),
        Some(Value::U32(v)) => Some((*v).into()),
        Some(Value::I8(v)) => Some((*v).into()),
        Some(Value::I16(v)) => Some((*v).into()),
        Some(Value::I32(v)) => Some((*v).into()),
        _ => return Ok(()),
    };
    match alignment {
        Some(a) if a > 0 && a % 8 == 0 => Ok(()),
        other => Err(format!(
            "general.alignment must be a non-zero multiple of 8, got {other:?}"
        )),
    }
}
