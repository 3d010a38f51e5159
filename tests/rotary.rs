//! Rotary position embeddings (`nn::RotaryEmbedding`) against Hugging Face Llama's
//! `apply_rotary_pos_emb` computed on the host: values, grads, offsets, views and errors.

mod common;
use common::*;
use wgrad::{nn, Tensor};

/// HF's reference: inv_freq and each angle in f32 (as transformers computes them), the
/// rotation in f64. `x` is `[rows, dim]` with row `r` at position `first + r % seq`.
fn rope_ref(x: &[f32], dim: usize, seq: usize, first: usize, theta: f32) -> Vec<f64> {
    let half = dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|j| 1.0 / theta.powf((2 * j) as f32 / dim as f32))
        .collect();
    let mut out = vec![0f64; x.len()];
    for (r, row) in x.chunks(dim).enumerate() {
        let position = (first + r % seq) as f32;
        for j in 0..half {
            let angle = (position * inv_freq[j]) as f64;
            let (s, c) = angle.sin_cos();
            let (x1, x2) = (row[j] as f64, row[j + half] as f64);
            out[r * dim + j] = x1 * c - x2 * s;
            out[r * dim + j + half] = x2 * c + x1 * s;
        }
    }
    out
}

#[test]
fn rotary_embedding_matches_hugging_face_llama() {
    let rope = nn::RotaryEmbedding::new(8, 64, 10_000.0, device()).unwrap();
    for (shape, first) in [
        (vec![1, 1, 1, 8], 0),
        (vec![2, 3, 5, 8], 0),
        (vec![3, 2, 7, 8], 40),
    ] {
        let (x, xs) = random_tensor(&shape, 1);
        let seq = shape[2];
        let got = rope.apply(&x, first).unwrap();
        assert_eq!(got.shape(), shape.as_slice());
        let want = rope_ref(&xs, 8, seq, first, 10_000.0);
        assert_close(
            &got.to_vec().unwrap(),
            &want,
            2e-5,
            &format!("rope {shape:?} from {first}"),
        );
    }
}

#[test]
fn rotary_embedding_at_far_positions_stays_close() {
    let rope = nn::RotaryEmbedding::new(64, 4096, 500_000.0, device()).unwrap();
    let (x, xs) = random_tensor(&[1, 1, 16, 64], 2);
    let got = rope.apply(&x, 4080).unwrap().to_vec().unwrap();
    // Angles near 4,000 rad carry f32 rounding of their own in transformers as here.
    assert_close(
        &got,
        &rope_ref(&xs, 64, 16, 4080, 500_000.0),
        2e-3,
        "rope at 4080..4096",
    );
}

#[test]
fn rotary_embedding_reads_a_transposed_view_and_its_grads_check() {
    let rope = nn::RotaryEmbedding::new(6, 16, 100.0, device()).unwrap();
    // [B, T, H, D] transposed to [B, H, T, D], as attention splits heads.
    let (x, xs) = random_tensor(&[2, 5, 3, 6], 3);
    let view = x.transpose(1, 2).unwrap();
    let got = rope.apply(&view, 2).unwrap().to_vec().unwrap();
    let dense = view.contiguous().unwrap().to_vec().unwrap();
    assert_close(
        &got,
        &rope_ref(&dense, 6, 5, 2, 100.0),
        2e-5,
        "rope of a view",
    );
    drop(xs);
    for batch in [1, 3] {
        gradcheck(
            "rotary_embedding",
            &[(vec![batch, 2, 4, 6], values_in(batch * 48, -1.0, 1.0, 4))],
            |t| rope.apply(&t[0].transpose(1, 2)?.transpose(1, 2)?, 3),
        );
    }
}

#[test]
fn rotary_embedding_names_bad_input() {
    let dev = device();
    assert!(nn::RotaryEmbedding::new(5, 8, 10_000.0, dev).is_err());
    assert!(nn::RotaryEmbedding::new(4, 8, 0.0, dev).is_err());
    let rope = nn::RotaryEmbedding::new(4, 8, 10_000.0, dev).unwrap();
    let err = rope
        .apply(&Tensor::zeros(&[1, 3, 6], dev).unwrap(), 0)
        .unwrap_err();
    assert!(err.to_string().contains("rotary_embedding") && err.to_string().contains("[1, 3, 6]"));
    let err = rope
        .apply(&Tensor::zeros(&[1, 3, 4], dev).unwrap(), 6)
        .unwrap_err();
    assert!(
        err.to_string().contains("pass the table's 8 positions"),
        "{err}"
    );
    // Empty inputs are fine.
    assert_eq!(
        rope.apply(&Tensor::zeros(&[0, 3, 4], dev).unwrap(), 0)
            .unwrap()
            .shape(),
        &[0, 3, 4]
    );
}

#[test]
fn a_captured_step_through_rotary_embeddings_equals_the_eager_one() {
    use wgrad::capture::Step;
    use wgrad::nn::Module;
    use wgrad::optim::{Optimizer, Sgd, SgdConfig};
    let dev = device();
    let rope = nn::RotaryEmbedding::new(8, 16, 10_000.0, dev).unwrap();
    let make = || nn::Linear::new(4, 8, true, dev).unwrap();
    let (eager, captured) = (make(), make());
    wgrad::no_grad(|| {
        for (a, b) in eager.parameters().iter().zip(captured.parameters()) {
            b.copy_(a).unwrap();
        }
    });
    let step_of = |model: &nn::Linear, opt: &mut Sgd, x: &Tensor, y: &Tensor| {
        opt.zero_grad();
        let loss = nn::loss::mse(&rope.apply(&model.forward(x)?, 1)?, y)?;
        loss.backward()?;
        opt.step()?;
        Ok(loss)
    };
    let mut eager_opt = Sgd::new(eager.parameters(), SgdConfig::default());
    let mut opt = Sgd::new(captured.parameters(), SgdConfig::default());
    let mut step = Step::new(|b: &[Tensor]| step_of(&captured, &mut opt, &b[0], &b[1]));
    for i in 0..5 {
        let (x, _) = random_tensor(&[2, 3, 4], 10 + i);
        let (y, _) = random_tensor(&[2, 3, 8], 20 + i);
        let want = step_of(&eager, &mut eager_opt, &x, &y)
            .unwrap()
            .item()
            .unwrap();
        let got = step.run(&[x, y]).unwrap().item().unwrap();
        assert!(
            (got - want).abs() <= 1e-6 * want.abs().max(1.0),
            "{got} vs {want}"
        );
    }
    assert_eq!(step.stats().replays, 3);
}
