//! The grad of every input of multi-input ops (weights, biases, keys and values, sources of
//! scatters) against central finite differences, on shapes and options drawn at random: the
//! fuzzer checks the grad of a program's first input only.

mod common;
use common::*;
use wgrad::nn::loss::{cross_entropy_with, CrossEntropyOptions, Reduction};
use wgrad::{Conv2dOptions, ConvTranspose2dOptions, SdpaOptions, Tensor};

/// A deterministic stream of small numbers for one case.
struct Draw(u64);

impl Draw {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

fn input(shape: &[usize], seed: u64) -> (Vec<usize>, Vec<f32>) {
    let n = shape.iter().product();
    (shape.to_vec(), values_in(n, -1.0, 1.0, seed))
}

const CASES: u64 = 12;

#[test]
fn conv2d_grads_of_input_weight_and_bias_match_finite_differences() {
    for case in 0..CASES {
        let mut d = Draw(case);
        let groups = 1 + d.below(2);
        let (c_in, c_out) = (groups * (1 + d.below(2)), groups * (1 + d.below(2)));
        let o = Conv2dOptions {
            stride: (1 + d.below(2), 1 + d.below(2)),
            padding: (d.below(2), d.below(2)),
            dilation: (1 + d.below(2), 1 + d.below(2)),
            groups,
        };
        let (kh, kw) = (1 + d.below(2), 1 + d.below(3));
        let x = input(
            &[1 + d.below(2), c_in, 4 + d.below(2), 5 + d.below(2)],
            case,
        );
        let w = input(&[c_out, c_in / groups, kh, kw], case + 100);
        let b = input(&[c_out], case + 200);
        gradcheck(&format!("conv2d {o:?} k {kh}x{kw}"), &[x, w, b], |t| {
            t[0].conv2d_with(&t[1], Some(&t[2]), o)
        });
    }
}

#[test]
fn conv_transpose2d_grads_of_input_weight_and_bias_match_finite_differences() {
    for case in 0..CASES {
        let mut d = Draw(case + 1000);
        let groups = 1 + d.below(2);
        let (c_in, c_out) = (groups * (1 + d.below(2)), groups * (1 + d.below(2)));
        let stride = 1 + d.below(2);
        let k = 1 + d.below(3);
        // Padding of at most half the kernel leaves an output.
        let o = ConvTranspose2dOptions {
            stride,
            padding: d.below(k.div_ceil(2)),
            output_padding: d.below(stride),
            dilation: 1 + d.below(2),
            groups,
        };
        let x = input(
            &[1 + d.below(2), c_in, 2 + d.below(3), 2 + d.below(2)],
            case,
        );
        let w = input(&[c_in, c_out / groups, k, k], case + 100);
        let b = input(&[c_out], case + 200);
        gradcheck(&format!("conv_transpose2d {o:?} k {k}"), &[x, w, b], |t| {
            t[0].conv_transpose2d(&t[1], Some(&t[2]), &o)
        });
    }
}

#[test]
fn norm_grads_of_input_weight_and_bias_match_finite_differences() {
    for case in 0..CASES {
        let mut d = Draw(case + 2000);
        let rows = 1 + d.below(4);
        // Rows of 3 or more: two values normalise to +-1 whatever they are, a function too
        // curved near a tie for differences of step 1e-2.
        let n = 3 + d.below(5);
        let x = input(&[rows, n], case);
        let (w, b) = (input(&[n], case + 100), input(&[n], case + 200));
        gradcheck("layer_norm", &[x.clone(), w.clone(), b], |t| {
            t[0].layer_norm(&t[1], &t[2], 1e-5)
        });
        gradcheck("rms_norm", &[x, w], |t| t[0].rms_norm(&t[1], 1e-6));
        let groups = 1 + d.below(2);
        let c = groups * (1 + d.below(2));
        let x = input(&[1 + d.below(2), c, 2 + d.below(2), 2], case + 300);
        let (w, b) = (input(&[c], case + 400), input(&[c], case + 500));
        gradcheck(
            &format!("group_norm {groups} of {:?}", x.0),
            &[x, w, b],
            |t| t[0].group_norm(groups, Some(&t[1]), Some(&t[2]), 1e-5),
        );
    }
}

#[test]
fn attention_grads_of_queries_keys_and_values_match_finite_differences() {
    for case in 0..CASES {
        let mut d = Draw(case + 3000);
        let kv_heads = 1 + d.below(2);
        let heads = kv_heads * (1 + d.below(2));
        let (t_q, t_k, dim, dv) = (
            1 + d.below(4),
            1 + d.below(5),
            1 + d.below(4),
            1 + d.below(3),
        );
        let q = input(&[1, heads, t_q, dim], case);
        let k = input(&[1, kv_heads, t_k, dim], case + 100);
        let v = input(&[1, kv_heads, t_k, dv], case + 200);
        let causal = d.below(2) == 0;
        // Half the cases drop keys with an additive mask (never every key of a row).
        let masked = d.below(2) == 0;
        let mask_values: Vec<f32> = (0..t_q * t_k)
            .map(|i| match masked && i % t_k != 0 && d.below(3) == 0 {
                true => f32::NEG_INFINITY,
                false => 0.0,
            })
            .collect();
        let mask = Tensor::from_vec(mask_values, &[t_q, t_k], device()).unwrap();
        let what =
            format!("sdpa heads {heads}/{kv_heads} {t_q}x{t_k} causal {causal} mask {masked}");
        gradcheck(&what, &[q, k, v], |t| {
            let opts = SdpaOptions {
                causal,
                mask: Some(&mask),
                scale: None,
            };
            t[0].scaled_dot_product_attention_with(&t[1], &t[2], &opts)
        });
    }
}

#[test]
fn scatter_grads_of_input_and_source_match_finite_differences() {
    for case in 0..CASES {
        let mut d = Draw(case + 4000);
        let (rows, cols) = (1 + d.below(4), 1 + d.below(4));
        let dim = d.below(2);
        let size = [rows, cols][dim];
        let k = 1 + d.below(4);
        let picks: Vec<u32> = (0..k).map(|_| d.below(size) as u32).collect();
        let mut source_shape = vec![rows, cols];
        source_shape[dim] = k;
        let x = input(&[rows, cols], case);
        let source = input(&source_shape, case + 100);
        let at = Tensor::from_vec_u32(picks, &[k], device()).unwrap();
        gradcheck("index_add", &[x.clone(), source.clone()], |t| {
            t[0].index_add(dim, &at, &t[1])
        });
        let n: usize = source_shape.iter().product();
        let per_element: Vec<u32> = (0..n).map(|_| d.below(size) as u32).collect();
        let at = Tensor::from_vec_u32(per_element, &source_shape, device()).unwrap();
        gradcheck("scatter_add", &[x, source], |t| {
            t[0].scatter_add(dim, &at, &t[1])
        });
    }
}

#[test]
fn cross_entropy_grads_with_weights_and_smoothing_match_finite_differences() {
    for case in 0..CASES {
        let mut d = Draw(case + 5000);
        let (n, c) = (1 + d.below(4), 2 + d.below(4));
        let labels: Vec<u32> = (0..n).map(|_| d.below(c) as u32).collect();
        let labels = Tensor::from_vec_u32(labels, &[n], device()).unwrap();
        let weight = Tensor::from_vec(values_in(c, 0.5, 2.0, case), &[c], device()).unwrap();
        let smoothing = [0.0, 0.1, 0.3][d.below(3)];
        let reduction = [Reduction::Mean, Reduction::Sum, Reduction::None][d.below(3)];
        let weighted = d.below(2) == 0;
        let what = format!("cross_entropy {reduction:?} smoothing {smoothing} weighted {weighted}");
        gradcheck(&what, &[input(&[n, c], case)], |t| {
            let opts = CrossEntropyOptions {
                label_smoothing: smoothing,
                weight: weighted.then_some(&weight),
                reduction,
                ..Default::default()
            };
            cross_entropy_with(&t[0], &labels, &opts)
        });
    }
}

#[test]
fn broadcast_binary_grads_of_both_operands_match_finite_differences() {
    for case in 0..CASES {
        let mut d = Draw(case + 6000);
        let shape: Vec<usize> = (0..1 + d.below(3)).map(|_| 1 + d.below(3)).collect();
        let other: Vec<usize> = shape[d.below(shape.len())..]
            .iter()
            .map(|&n| if d.below(2) == 0 { 1 } else { n })
            .collect();
        let (a, b) = (input(&shape, case), input(&other, case + 100));
        gradcheck("mul", &[a.clone(), b.clone()], |t| t[0].mul(&t[1]));
        gradcheck(
            "div",
            &[
                a.clone(),
                (b.0.clone(), b.1.iter().map(|v| v.abs() + 0.5).collect()),
            ],
            |t| t[0].div(&t[1]),
        );
        let base = (a.0.clone(), a.1.iter().map(|v| v.abs() + 0.5).collect());
        gradcheck("pow", &[base, b], |t| t[0].pow(&t[1]));
        let mut m = shape.clone();
        let k = 1 + d.below(3);
        m.push(k);
        let w = input(&[k, 1 + d.below(3)], case + 200);
        gradcheck("matmul", &[input(&m, case + 300), w], |t| {
            t[0].matmul(&t[1])
        });
    }
}
