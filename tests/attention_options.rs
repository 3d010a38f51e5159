//! `scaled_dot_product_attention_with`: masks (F32 added, U32 keep), an explicit scale and
//! grouped-query heads, against an f64 CPU reference (values and all three grads) on both
//! kernel flavours, against finite differences, past the loop-split thresholds, and its
//! errors.

mod common;
use common::*;
use wgrad::{BackwardOptions, Device, Error, KernelFlavor, SdpaOptions, Tensor};

/// The mask of one call, given in full over `[heads, tq, tk]` (q's heads).
#[derive(Clone)]
enum Mask {
    None,
    /// Added to the scaled scores (`-inf` drops a key).
    Additive(Vec<f32>),
    /// Nonzero: attend.
    Keep(Vec<u32>),
}

impl Mask {
    /// The term added to score (h, i, j), or `None` where the key is dropped.
    fn term(&self, at: usize) -> Option<f64> {
        match self {
            Mask::None => Some(0.0),
            Mask::Additive(m) if m[at] == f32::NEG_INFINITY => None,
            Mask::Additive(m) => Some(m[at] as f64),
            Mask::Keep(m) => (m[at] != 0).then_some(0.0),
        }
    }
}

/// One call's sizes: `heads` q heads reading `heads / group` k/v heads.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    heads: usize,
    group: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
}

/// Forward and grads on the CPU: q `[heads, tq, d]`, k `[heads / group, tk, d]`, v
/// `[heads / group, tk, dv]`, out grad `[heads, tq, dv]`. A row whose keys are all dropped
/// gives 0 and no grad. Returns (out, dq, dk, dv).
#[allow(clippy::type_complexity)]
fn reference(
    (q, k, v, g): (&[f32], &[f32], &[f32], &[f32]),
    s: Sizes,
    causal: bool,
    scale: f64,
    mask: &Mask,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let Sizes {
        heads,
        group,
        tq,
        tk,
        d,
        dv,
    } = s;
    let kv_heads = heads / group;
    let mut out = vec![0.0; heads * tq * dv];
    let mut dq = vec![0.0; heads * tq * d];
    let mut dk = vec![0.0; kv_heads * tk * d];
    let mut dvv = vec![0.0; kv_heads * tk * dv];
    for h in 0..heads {
        let hk = h / group;
        let (qo, ko, vo) = (h * tq * d, hk * tk * d, hk * tk * dv);
        for i in 0..tq {
            let scores: Vec<Option<f64>> = (0..tk)
                .map(|j| {
                    if causal && j > i {
                        return None;
                    }
                    let term = mask.term((h * tq + i) * tk + j)?;
                    let dot: f64 = (0..d)
                        .map(|c| q[qo + i * d + c] as f64 * k[ko + j * d + c] as f64)
                        .sum();
                    Some(dot * scale + term)
                })
                .collect();
            let m = scores
                .iter()
                .flatten()
                .cloned()
                .fold(f64::NEG_INFINITY, f64::max);
            if m == f64::NEG_INFINITY {
                continue;
            }
            let z: f64 = scores.iter().flatten().map(|x| (x - m).exp()).sum();
            let p: Vec<f64> = scores
                .iter()
                .map(|x| x.map_or(0.0, |x| (x - m).exp() / z))
                .collect();
            let gi = &g[(h * tq + i) * dv..(h * tq + i + 1) * dv];
            let dp: Vec<f64> = (0..tk)
                .map(|j| {
                    (0..dv)
                        .map(|c| gi[c] as f64 * v[vo + j * dv + c] as f64)
                        .sum()
                })
                .collect();
            let delta: f64 = (0..tk).map(|j| p[j] * dp[j]).sum();
            for j in 0..tk {
                for c in 0..dv {
                    out[(h * tq + i) * dv + c] += p[j] * v[vo + j * dv + c] as f64;
                    dvv[(hk * tk + j) * dv + c] += p[j] * gi[c] as f64;
                }
                let ds = p[j] * (dp[j] - delta) * scale;
                for c in 0..d {
                    dq[qo + i * d + c] += ds * k[ko + j * d + c] as f64;
                    dk[ko + j * d + c] += ds * q[qo + i * d + c] as f64;
                }
            }
        }
    }
    (out, dq, dk, dvv)
}

/// The mask tensor of `mask`'s first values at `shape`.
fn mask_tensor(mask: &Mask, shape: &[usize], dev: &Device) -> Option<Tensor> {
    let n: usize = shape.iter().product();
    match mask {
        Mask::None => None,
        Mask::Additive(m) => Some(Tensor::from_slice(&m[..n], shape, dev).unwrap()),
        Mask::Keep(m) => Some(Tensor::from_vec_u32(m[..n].to_vec(), shape, dev).unwrap()),
    }
}

/// `pattern` of `shape` broadcast to `full`, as torch broadcasts (dims aligned right).
fn broadcast_full<T: Copy>(pattern: &[T], shape: &[usize], full: &[usize]) -> Vec<T> {
    let pad = full.len() - shape.len();
    let pstrides = strides(shape);
    (0..full.iter().product())
        .map(|flat| {
            let idx = unravel(flat, full);
            let at: usize = (0..shape.len())
                .map(|dd| {
                    if shape[dd] == 1 {
                        0
                    } else {
                        idx[pad + dd] * pstrides[dd]
                    }
                })
                .sum();
            pattern[at]
        })
        .collect()
}

/// Runs one call on `dev` and checks its output and all grads against the reference. q is
/// `[B, H, Tq, D]` with `heads = B H`; the mask has `mask_shape`.
fn check_call(
    dev: &Device,
    (b, s): (usize, Sizes),
    causal: bool,
    scale: Option<f32>,
    (pattern, mask_shape): (&Mask, &[usize]),
) {
    let what = format!(
        "{s:?} b {b} causal {causal} scale {scale:?} mask {mask_shape:?} flavor {:?}",
        dev.kernel_flavor()
    );
    let h = s.heads / b;
    let make = |shape: &[usize], seed| {
        let data = random_vec(shape.iter().product(), seed);
        let t = Tensor::from_slice(&data, shape, dev)
            .unwrap()
            .requires_grad_(true);
        (t, data)
    };
    let (q, qv) = make(&[b, h, s.tq, s.d], 1);
    let (k, kv) = make(&[b, h / s.group, s.tk, s.d], 2);
    let (v, vv) = make(&[b, h / s.group, s.tk, s.dv], 3);
    let gv = random_vec(s.heads * s.tq * s.dv, 4);
    let g = Tensor::from_slice(&gv, &[b, h, s.tq, s.dv], dev).unwrap();
    let full = [b, h, s.tq, s.tk];
    let (mask_t, mask_full) = match pattern {
        Mask::None => (None, Mask::None),
        Mask::Additive(m) => (
            mask_tensor(pattern, mask_shape, dev),
            Mask::Additive(broadcast_full(m, mask_shape, &full)),
        ),
        Mask::Keep(m) => (
            mask_tensor(pattern, mask_shape, dev),
            Mask::Keep(broadcast_full(m, mask_shape, &full)),
        ),
    };
    let opts = SdpaOptions {
        causal,
        mask: mask_t.as_ref(),
        scale,
    };
    let out = q.scaled_dot_product_attention_with(&k, &v, &opts).unwrap();
    assert_eq!(out.shape(), &[b, h, s.tq, s.dv], "{what}");
    out.backward_with(BackwardOptions {
        grad_output: Some(g),
        ..Default::default()
    })
    .unwrap();
    let scale = scale.map_or(1.0 / (s.d as f64).sqrt(), |x| x as f64);
    let want = reference((&qv, &kv, &vv, &gv), s, causal, scale, &mask_full);
    let got = |t: &Tensor| t.to_vec().unwrap();
    assert_close(&got(&out), &want.0, 1e-4, &format!("out, {what}"));
    assert_close(
        &got(&q.grad().unwrap()),
        &want.1,
        1e-3,
        &format!("dq, {what}"),
    );
    assert_close(
        &got(&k.grad().unwrap()),
        &want.2,
        1e-3,
        &format!("dk, {what}"),
    );
    assert_close(
        &got(&v.grad().unwrap()),
        &want.3,
        1e-3,
        &format!("dv, {what}"),
    );
}

/// Every test's calls, on the shared device (the CPU flavour with 8-wide subgroups on
/// lavapipe) and on a second device forced to the GPU flavour (no subgroups).
fn on_both_flavours(calls: impl Fn(&Device)) {
    calls(device());
    let gpu = Device::software().unwrap();
    gpu.set_kernel_flavor(KernelFlavor::Gpu);
    calls(&gpu);
}

/// A padding keep-mask `[B, 1, 1, Tk]`: batch row `r` attends to its first `tk - 2 r` keys.
fn padding(b: usize, tk: usize) -> Mask {
    Mask::Keep(
        (0..b * tk)
            .map(|at| u32::from(at % tk + 2 * (at / tk) < tk))
            .collect(),
    )
}

fn sizes(b: usize, h: usize, group: usize, tq: usize, tk: usize, d: usize, dv: usize) -> Sizes {
    Sizes {
        heads: b * h,
        group,
        tq,
        tk,
        d,
        dv,
    }
}

#[test]
fn keep_mask_for_padding_matches_reference() {
    on_both_flavours(|dev| {
        for causal in [false, true] {
            let s = sizes(3, 2, 1, 7, 7, 8, 8);
            check_call(dev, (3, s), causal, None, (&padding(3, 7), &[3, 1, 1, 7]));
        }
        // Rows in whole 8s (the shared entries' subgroups), ragged features.
        let s = sizes(2, 2, 1, 16, 24, 5, 7);
        check_call(dev, (2, s), false, None, (&padding(2, 24), &[2, 1, 1, 24]));
    });
}

/// Rows past one workgroup's 64 and keys past one tile (the GPU flavour's flash tiles hold 32
/// keys of 64 features): grouped-query heads, a padding mask and causal together.
#[test]
fn options_hold_across_tiles_and_row_blocks() {
    on_both_flavours(|dev| {
        for causal in [false, true] {
            let s = sizes(2, 4, 2, 70, 100, 64, 64);
            check_call(
                dev,
                (2, s),
                causal,
                None,
                (&padding(2, 100), &[2, 1, 1, 100]),
            );
        }
    });
}

#[test]
fn additive_mask_matches_reference_with_dropped_keys() {
    on_both_flavours(|dev| {
        // [Tq, Tk] shared by every head: values in [-2, 2), every third key -inf.
        let (tq, tk) = (9, 11);
        let m: Vec<f32> = values_in(tq * tk, -2.0, 2.0, 7)
            .into_iter()
            .enumerate()
            .map(|(at, x)| if at % 3 == 1 { f32::NEG_INFINITY } else { x })
            .collect();
        let s = sizes(2, 3, 1, tq, tk, 6, 4);
        check_call(
            dev,
            (2, s),
            false,
            None,
            (&Mask::Additive(m.clone()), &[tq, tk]),
        );
        check_call(dev, (2, s), true, None, (&Mask::Additive(m), &[tq, tk]));
        // One mask per head and query row, [B, H, Tq, Tk].
        let m = values_in(2 * 3 * tq * tk, -1.0, 1.0, 8);
        check_call(
            dev,
            (2, s),
            false,
            None,
            (&Mask::Additive(m), &[2, 3, tq, tk]),
        );
    });
}

#[test]
fn explicit_scale_replaces_one_over_sqrt_d() {
    on_both_flavours(|dev| {
        let s = sizes(1, 2, 1, 5, 6, 8, 4);
        check_call(dev, (1, s), false, Some(0.7), (&Mask::None, &[]));
        check_call(dev, (1, s), true, Some(-1.5), (&Mask::None, &[]));
    });
}

#[test]
fn grouped_query_attention_matches_reference() {
    on_both_flavours(|dev| {
        for causal in [false, true] {
            // 8 q heads reading 2 k/v heads, and 4 reading 1 (multi-query).
            check_call(
                dev,
                (2, sizes(2, 8, 4, 7, 7, 8, 8)),
                causal,
                None,
                (&Mask::None, &[]),
            );
            check_call(
                dev,
                (1, sizes(1, 4, 4, 16, 16, 8, 4)),
                causal,
                None,
                (&Mask::None, &[]),
            );
        }
        // With a padding mask, as a Llama batch.
        let s = sizes(2, 6, 3, 9, 9, 4, 4);
        check_call(dev, (2, s), true, None, (&padding(2, 9), &[2, 1, 1, 9]));
    });
}

#[test]
fn a_row_with_every_key_masked_gives_zeros_and_no_grad() {
    let dev = device();
    // Batch row 1 masks every key: its output rows and the grads through them are 0.
    let keep = Tensor::from_vec_u32(vec![1, 1, 0, 0, 0, 0], &[2, 1, 1, 3], dev).unwrap();
    let q = Tensor::randn(&[2, 1, 2, 4], 1, dev)
        .unwrap()
        .requires_grad_(true);
    let kv = Tensor::randn(&[2, 1, 3, 4], 2, dev)
        .unwrap()
        .requires_grad_(true);
    let opts = SdpaOptions {
        mask: Some(&keep),
        ..Default::default()
    };
    let out = q
        .scaled_dot_product_attention_with(&kv, &kv, &opts)
        .unwrap();
    out.sum().unwrap().backward().unwrap();
    let out = out.to_vec().unwrap();
    assert!(out[8..].iter().all(|&x| x == 0.0), "{out:?}");
    assert!(out[..8].iter().any(|&x| x != 0.0), "{out:?}");
    let dq = q.grad().unwrap().to_vec().unwrap();
    assert!(dq[8..].iter().all(|&x| x == 0.0), "{dq:?}");
    let dkv = kv.grad().unwrap().to_vec().unwrap();
    assert!(dkv[12..].iter().all(|&x| x == 0.0), "{dkv:?}");
    assert!(dkv.iter().all(|x| x.is_finite()), "{dkv:?}");
}

#[test]
fn masked_grouped_query_attention_passes_gradcheck() {
    for (b, t) in [(1, 1), (3, 5)] {
        let (h, hkv, d) = (4, 2, 4);
        let keep = match padding(b, t) {
            Mask::Keep(m) => m,
            _ => unreachable!(),
        };
        gradcheck(
            &format!("masked gqa b {b} t {t}"),
            &[
                (vec![b, h, t, d], values_in(b * h * t * d, -1.0, 1.0, 1)),
                (vec![b, hkv, t, d], values_in(b * hkv * t * d, -1.0, 1.0, 2)),
                (vec![b, hkv, t, d], values_in(b * hkv * t * d, -1.0, 1.0, 3)),
            ],
            |x| {
                let mask = Tensor::from_vec_u32(keep.clone(), &[b, 1, 1, t], device())?;
                let opts = SdpaOptions {
                    causal: true,
                    mask: Some(&mask),
                    scale: Some(0.4),
                };
                x[0].scaled_dot_product_attention_with(&x[1], &x[2], &opts)
            },
        );
    }
}

#[test]
fn non_contiguous_heads_with_mask_and_groups_match_contiguous_copies() {
    let dev = device();
    // [B, T, H, D] laid out, viewed as [B, H, T, D], as a Llama attention makes them.
    let view = |h: usize, seed| {
        Tensor::randn(&[2, 5, h, 8], seed, dev)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    };
    let (q, k, v) = (view(4, 1), view(2, 2), view(2, 3));
    let keep =
        Tensor::from_vec_u32(vec![1, 1, 1, 1, 1, 1, 1, 1, 0, 0], &[2, 1, 1, 5], dev).unwrap();
    let opts = SdpaOptions {
        causal: true,
        mask: Some(&keep),
        scale: None,
    };
    let got = q.scaled_dot_product_attention_with(&k, &v, &opts).unwrap();
    let dense = |x: &Tensor| x.contiguous().unwrap();
    let want = dense(&q)
        .scaled_dot_product_attention_with(&dense(&k), &dense(&v), &opts)
        .unwrap();
    let want: Vec<f64> = want.to_vec().unwrap().iter().map(|&x| x as f64).collect();
    assert_close(&got.to_vec().unwrap(), &want, 1e-5, "views");
}

/// Long rows take the split paths (the forward's combine, the backward's launches per span),
/// with a mask and with groups (a key row loops over `group` heads' queries, so its spans
/// are shorter).
#[test]
fn masked_grouped_attention_splits_long_sequences() {
    let dev = device();
    let tk = 40_000;
    let s = sizes(1, 2, 1, 2, tk, 4, 4);
    check_call(dev, (1, s), false, None, (&padding(1, tk), &[1, 1, 1, tk]));
    let s = sizes(1, 4, 4, 20_000, 2, 4, 4);
    check_call(dev, (1, s), false, None, (&Mask::None, &[]));
}

fn expect_error(result: wgrad::Result<Tensor>, needle: &str) {
    match result {
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("scaled_dot_product_attention"), "{msg}");
            assert!(msg.contains(needle), "{msg} lacks {needle}");
        }
        Ok(t) => panic!("expected an error, got a tensor of shape {:?}", t.shape()),
    }
}

#[test]
fn bad_options_are_errors_naming_the_shapes() {
    let dev = device();
    let t = |s: &[usize]| Tensor::zeros(s, dev).unwrap();
    let q = t(&[2, 6, 5, 4]);
    let with = |k: &Tensor, mask: Option<&Tensor>, scale| {
        q.scaled_dot_product_attention_with(
            k,
            k,
            &SdpaOptions {
                causal: false,
                mask,
                scale,
            },
        )
    };
    // 6 q heads cannot share 4 k/v heads.
    expect_error(with(&t(&[2, 4, 5, 4]), None, None), "[2, 4, 5, 4]");
    // A mask that does not broadcast to [2, 6, 5, 7].
    let k = t(&[2, 3, 7, 4]);
    expect_error(with(&k, Some(&t(&[2, 1, 1, 5])), None), "[2, 1, 1, 5]");
    expect_error(with(&k, Some(&t(&[3, 1, 5, 7])), None), "[2, 6, 5, 7]");
    // A mask that wants a grad, a scale that is not finite.
    let learnt = t(&[5, 7]).requires_grad_(true);
    expect_error(with(&k, Some(&learnt), None), "no grad");
    expect_error(with(&k, None, Some(f32::NAN)), "scale");
    assert!(matches!(
        with(&t(&[2, 4, 5, 4]), None, None),
        Err(Error::Shape { .. })
    ));
}

#[test]
fn masked_grouped_attention_of_head_views_passes_gradcheck() {
    // q, k, v as [B, T, H, D] leaves read through [B, H, T, D] views (non-contiguous), with
    // an additive [T, T] mask and 2 q heads per k/v head.
    let (b, t, d) = (1, 3, 4);
    let mask: Vec<f32> = values_in(t * t, -1.0, 1.0, 9);
    gradcheck(
        "masked gqa of views",
        &[
            (vec![b, t, 4, d], values_in(b * t * 4 * d, -1.0, 1.0, 4)),
            (vec![b, t, 2, d], values_in(b * t * 2 * d, -1.0, 1.0, 5)),
            (vec![b, t, 2, d], values_in(b * t * 2 * d, -1.0, 1.0, 6)),
        ],
        |x| {
            let m = Tensor::from_slice(&mask, &[t, t], device())?;
            let opts = SdpaOptions {
                causal: false,
                mask: Some(&m),
                scale: None,
            };
            let view = |i: usize| x[i].transpose(1, 2);
            view(0)?.scaled_dot_product_attention_with(&view(1)?, &view(2)?, &opts)
        },
    );
}
