//! GGUF reading's tests: tensor names, dtypes, quantization policies.

use super::*;

#[test]
fn names_map_to_gguf() {
    for (hf, gguf) in [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
        (
            "model.layers.3.input_layernorm.weight",
            "blk.3.attn_norm.weight",
        ),
        (
            "model.layers.12.post_attention_layernorm.weight",
            "blk.12.ffn_norm.weight",
        ),
        ("model.layers.0.self_attn.q_proj.bias", "blk.0.attn_q.bias"),
        (
            "model.layers.0.self_attn.o_proj.weight",
            "blk.0.attn_output.weight",
        ),
        (
            "model.layers.1.mlp.down_proj.weight",
            "blk.1.ffn_down.weight",
        ),
    ] {
        assert_eq!(gguf_name(hf).as_deref(), Some(gguf), "{hf}");
    }
    assert_eq!(gguf_name("model.layers.0.mlp.experts.weight"), None);
}

/// A Q8_0 weight widened with zero blocks, times an input widened with zeros, is as close
/// to the exact product as the weight as stored (candle's tiled kernel then runs it, and
/// quantizes the input its own way, so the two differ by rounding).
#[test]
fn q8_0_rows_padded_with_zero_blocks_multiply_the_same() {
    use candle_core::Module;
    let dev = Device::Cpu;
    let (out, k) = (64, 576);
    // (out, k), values spread over a few magnitudes.
    let w: Vec<f32> = (0..out * k)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1 + i % 3) as f32)
        .collect();
    let w = Tensor::from_vec(w, (out, k), &dev).unwrap();
    let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
    let padded = pad_q8_0_rows(&q.data().unwrap(), out, k, 768);
    assert_eq!(padded.len(), out * 768 / 32 * 34);
    let storage =
        QStorage::from_data(std::borrow::Cow::Owned(padded), &dev, GgmlDType::Q8_0).unwrap();
    let wide = QMatMul::from_qtensor(QTensor::new(storage, (out, 768)).unwrap()).unwrap();
    let narrow = QMatMul::from_qtensor(q).unwrap();
    for m in [1, 5, 16] {
        // (m, k)
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 17.0)
            .collect();
        let x = Tensor::from_vec(x, (m, k), &dev).unwrap();
        let want: Vec<f32> = narrow
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let xw = x
            .pad_with_zeros(1, 0, 768 - k)
            .unwrap()
            .contiguous()
            .unwrap();
        let got: Vec<f32> = wide
            .forward(&xw)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let exact: Vec<f32> = x
            .matmul(&w.t().unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let err = |a: &[f32]| {
            let num: f32 = a.iter().zip(&exact).map(|(a, e)| (a - e) * (a - e)).sum();
            let den: f32 = exact.iter().map(|e| e * e).sum();
            (num / den).sqrt()
        };
        // The tiled kernel quantizes the input its own way, so the two differ by rounding,
        // not by accuracy: both are as close to the exact product.
        let (padded, stored) = (err(&got), err(&want));
        assert!(
            padded <= stored * 1.2 + 1e-4,
            "m={m}: padded {padded:.3e}, stored {stored:.3e}"
        );
        assert!(padded < 2e-2, "m={m}: padded {padded:.3e}");
    }
}

#[test]
fn plans() {
    assert_eq!(
        plan(GgmlDType::Q4_1, QuantPolicy::Fast),
        Some(Plan::OwnQ4_1)
    );
    assert_eq!(
        plan(GgmlDType::Q4_1, QuantPolicy::CandleKernels),
        Some(Plan::Requantize(GgmlDType::Q8_0))
    );
    assert_eq!(
        plan(GgmlDType::Q5_1, QuantPolicy::Fast),
        Some(Plan::Requantize(GgmlDType::Q8_0))
    );
    assert_eq!(
        plan(GgmlDType::Q4_1, QuantPolicy::AsStored),
        Some(Plan::Keep)
    );
    assert_eq!(plan(GgmlDType::Q5_0, QuantPolicy::Dense), Some(Plan::Dense));
    assert_eq!(plan(GgmlDType::Q8_0, QuantPolicy::Dense), Some(Plan::Dense));
    assert_eq!(plan(GgmlDType::Q8_0, QuantPolicy::Fast), Some(Plan::Keep));
    assert_eq!(
        plan(GgmlDType::F16, QuantPolicy::AsStored),
        Some(Plan::Dense)
    );
    assert_eq!(plan(GgmlDType::Q8K, QuantPolicy::AsStored), None);
}

/// A header whose `general.alignment` is 0 (candle's reader divides by it) is refused with an
/// error naming the file, not a panic; so is one whose alignment is not a power of two.
#[test]
fn a_zero_or_odd_alignment_is_an_error_not_a_panic() {
    let dir = std::env::temp_dir().join(format!("pd-gguf-alignment-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for alignment in [0u32, 3] {
        let path = dir.join(format!("align-{alignment}.gguf"));
        let mut file = std::fs::File::create(&path).unwrap();
        let value = gguf_file::Value::U32(alignment);
        gguf_file::write(&mut file, &[("general.alignment", &value)], &[]).unwrap();
        drop(file);
        match GgufFile::open(&path) {
            Err(ModelError::Gguf { path: p, source }) => {
                assert_eq!(p, path);
                assert!(source.to_string().contains("alignment"), "{source}");
            }
            Err(e) => panic!("alignment {alignment}: {e}"),
            Ok(_) => panic!("alignment {alignment}: a header candle cannot place was opened"),
        }
    }
    // A valid one opens.
    let path = dir.join("align-32.gguf");
    let mut file = std::fs::File::create(&path).unwrap();
    let value = gguf_file::Value::U32(32);
    gguf_file::write(&mut file, &[("general.alignment", &value)], &[]).unwrap();
    drop(file);
    GgufFile::open(&path).expect("alignment 32");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tensor whose shape asks for more bytes than the file holds (or whose dimensions overflow
/// when multiplied) is refused at open naming it, before anything reads or allocates it.
#[test]
fn a_tensor_larger_than_its_file_is_refused_at_open() {
    use candle_core::quantized::QTensor;
    let dir = std::env::temp_dir().join(format!("pd-gguf-extent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("small.gguf");
    let t = QTensor::quantize(
        &candle_core::Tensor::zeros((4, 32), candle_core::DType::F32, &candle_core::Device::Cpu)
            .unwrap(),
        candle_core::quantized::GgmlDType::F32,
    )
    .unwrap();
    let mut file = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut file, &[], &[("w", &t)]).unwrap();
    drop(file);
    GgufFile::open(&path).expect("a tensor that fits");
    // Grow the first dimension in the header: the same 512 bytes on disk, 2^40 rows said.
    let mut bytes = std::fs::read(&path).unwrap();
    let dims_at = bytes
        .windows(16)
        .position(|w| w[..8] == 32u64.to_le_bytes() && w[8..] == 4u64.to_le_bytes())
        .expect("the dims in the header");
    bytes[dims_at + 8..dims_at + 16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    match GgufFile::open(&path) {
        Err(ModelError::Gguf { source, .. }) => {
            assert!(source.to_string().contains("tensor `w`"), "{source}");
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a tensor of 2^40 rows in a small file was opened"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}
