//! scaled_dot_product_attention against an f64 CPU reference (values and all three grads),
//! against finite differences (S-13), past the loop-split thresholds, and its errors.

mod common;
use common::*;
use wgrad::{BackwardOptions, Device, Error, KernelFlavor, Tensor};

/// Forward and grads of attention on the CPU for one head: q [tq, d], k [tk, d], v [tk, dv],
/// out grad g [tq, dv]. Returns (out, dq, dk, dv).
#[allow(clippy::type_complexity)]
fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    (tq, tk, d, dv): (usize, usize, usize, usize),
    causal: bool,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let scale = 1.0 / (d as f64).sqrt();
    let (mut out, mut dq, mut dk, mut dvv) = (
        vec![0.0; tq * dv],
        vec![0.0; tq * d],
        vec![0.0; tk * d],
        vec![0.0; tk * dv],
    );
    for i in 0..tq {
        let keys = if causal { (i + 1).min(tk) } else { tk };
        let s: Vec<f64> = (0..keys)
            .map(|j| {
                (0..d)
                    .map(|c| q[i * d + c] as f64 * k[j * d + c] as f64)
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        let p: Vec<f64> = e.iter().map(|x| x / z).collect();
        for j in 0..keys {
            for c in 0..dv {
                out[i * dv + c] += p[j] * v[j * dv + c] as f64;
            }
        }
        let dp: Vec<f64> = (0..keys)
            .map(|j| {
                (0..dv)
                    .map(|c| g[i * dv + c] as f64 * v[j * dv + c] as f64)
                    .sum()
            })
            .collect();
        let delta: f64 = (0..keys).map(|j| p[j] * dp[j]).sum();
        for j in 0..keys {
            let ds = p[j] * (dp[j] - delta) * scale;
            for c in 0..d {
                dq[i * d + c] += ds * k[j * d + c] as f64;
                dk[j * d + c] += ds * q[i * d + c] as f64;
            }
            for c in 0..dv {
                dvv[j * dv + c] += p[j] * g[i * dv + c] as f64;
            }
        }
    }
    (out, dq, dk, dvv)
}

/// Runs attention on `heads` heads on `dev` and checks the output and all grads against the
/// reference.
fn check_against_reference(
    dev: &Device,
    heads: usize,
    (tq, tk): (usize, usize),
    (d, dv): (usize, usize),
    causal: bool,
) {
    let what = format!("heads {heads} tq {tq} tk {tk} d {d} dv {dv} causal {causal}");
    let random = |shape: &[usize], seed| {
        let values = random_vec(shape.iter().product(), seed);
        (Tensor::from_slice(&values, shape, dev).unwrap(), values)
    };
    let (q, qv) = random(&[heads, tq, d], 1);
    let (k, kv) = random(&[heads, tk, d], 2);
    let (v, vv) = random(&[heads, tk, dv], 3);
    let (g, gv) = random(&[heads, tq, dv], 4);
    let (q, k, v) = (
        q.requires_grad_(true),
        k.requires_grad_(true),
        v.requires_grad_(true),
    );
    let out = q.scaled_dot_product_attention(&k, &v, causal).unwrap();
    assert_eq!(out.shape(), &[heads, tq, dv], "{what}");
    out.backward_with(BackwardOptions {
        grad_output: Some(g),
        ..Default::default()
    })
    .unwrap();
    let mut want = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for h in 0..heads {
        let r = reference(
            &qv[h * tq * d..(h + 1) * tq * d],
            &kv[h * tk * d..(h + 1) * tk * d],
            &vv[h * tk * dv..(h + 1) * tk * dv],
            &gv[h * tq * dv..(h + 1) * tq * dv],
            (tq, tk, d, dv),
            causal,
        );
        want.0.extend(r.0);
        want.1.extend(r.1);
        want.2.extend(r.2);
        want.3.extend(r.3);
    }
    assert_close(
        &out.to_vec().unwrap(),
        &want.0,
        1e-4,
        &format!("out, {what}"),
    );
    assert_close(
        &q.grad().unwrap().to_vec().unwrap(),
        &want.1,
        1e-3,
        &format!("dq, {what}"),
    );
    assert_close(
        &k.grad().unwrap().to_vec().unwrap(),
        &want.2,
        1e-3,
        &format!("dk, {what}"),
    );
    assert_close(
        &v.grad().unwrap().to_vec().unwrap(),
        &want.3,
        1e-3,
        &format!("dv, {what}"),
    );
}

#[test]
fn sdpa_matches_cpu_reference_causal_and_not() {
    for causal in [false, true] {
        for t in [1, 7, 65] {
            check_against_reference(device(), 3, (t, t), (8, 8), causal);
        }
    }
    check_against_reference(device(), 2, (5, 9), (6, 3), false); // Tq != Tk, D and Dv not multiples of 4
    check_against_reference(device(), 2, (9, 5), (5, 7), true); // causal with Tq > Tk, aligned top-left
    check_against_reference(device(), 1, (3, 4), (256, 4), false); // the widest head
}

/// Adapters with 8-wide subgroups run kernels whose 8 invocations own 8 rows of one head and
/// load each row of the other side once between them (a head's rows padded to whole 8s; the
/// other tests' odd T take the padding). These shapes have rows in whole 8s: causal (each
/// subgroup loops over the union of its rows' ranges), Tq != Tk, heads past 8 feature groups
/// (D 36: two groups of 8, the second padded), ragged features, and a forward split across
/// invocations.
#[test]
fn sdpa_matches_cpu_reference_where_rows_come_in_eights() {
    for causal in [false, true] {
        check_against_reference(device(), 3, (16, 16), (8, 8), causal);
        check_against_reference(device(), 2, (64, 64), (32, 32), causal);
    }
    check_against_reference(device(), 2, (8, 24), (36, 12), false);
    check_against_reference(device(), 2, (24, 8), (5, 7), true);
    check_against_reference(device(), 2, (16, 40), (8, 4), true);
    check_against_reference(device(), 1, (8, 40_000), (4, 4), false);
}

/// The GPU flavour's kernels (flash tiles; in lane groups where the device has subgroups, as
/// lavapipe has) agree with the CPU flavour's (the shared ones on 8-wide subgroups): a
/// software device set to the GPU kernel flavour runs them.
#[test]
fn sdpa_kernels_without_subgroups_match_the_shared_ones() {
    let dev = Device::software().unwrap();
    let run = |flavor: KernelFlavor| {
        dev.set_kernel_flavor(flavor);
        let make = |shape: &[usize], seed| {
            Tensor::from_slice(&random_vec(shape.iter().product(), seed), shape, &dev)
                .unwrap()
                .requires_grad_(true)
        };
        let (q, k, v) = (
            make(&[2, 9, 8], 1),
            make(&[2, 9, 8], 2),
            make(&[2, 9, 4], 3),
        );
        let g = make(&[2, 9, 4], 4);
        let out = q.scaled_dot_product_attention(&k, &v, true).unwrap();
        out.mul(&g).unwrap().sum().unwrap().backward().unwrap();
        [out, q.grad().unwrap(), k.grad().unwrap(), v.grad().unwrap()].map(|t| t.to_vec().unwrap())
    };
    let gpu = run(KernelFlavor::Gpu);
    let cpu = run(KernelFlavor::Cpu);
    for (i, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        let want: Vec<f64> = c.iter().map(|&x| x as f64).collect();
        assert_close(g, &want, 1e-5, &format!("result {i}"));
    }
}

/// The GPU flavour's flash tiles (a workgroup owns 64 rows of one head, in lane groups of 8
/// rows where the device has subgroups; a tile holds 32 keys of 64 features, or 64 of fewer)
/// against the reference: rows and keys past one block and one
/// tile, padding rows, causal with more keys than queries and fewer, ragged and wide features,
/// and lengths past 65,536 on either side (the loops split across invocations).
#[test]
fn sdpa_flash_tiles_match_cpu_reference() {
    let dev = Device::software().unwrap();
    dev.set_kernel_flavor(KernelFlavor::Gpu);
    for causal in [false, true] {
        check_against_reference(&dev, 3, (130, 70), (64, 64), causal);
        check_against_reference(&dev, 2, (65, 129), (6, 3), causal);
    }
    // Three feature groups a lane in the lane groups, and value rows ending inside a group.
    check_against_reference(&dev, 1, (70, 33), (96, 40), true);
    check_against_reference(&dev, 1, (2, 70_000), (4, 4), false);
    check_against_reference(&dev, 1, (70_000, 2), (4, 4), true);
}

/// Past about 6,000 keys (or queries) per row (fewer for wider heads) an invocation would run more loop iterations
/// than llvmpipe allows; the loops are then split across invocations and the partial results
/// joined. These shapes take the split path in the forward, the query grad and the key grads.
#[test]
fn sdpa_splits_long_sequences_across_invocations() {
    check_against_reference(device(), 1, (2, 40_000), (4, 4), false);
    check_against_reference(device(), 1, (40_000, 2), (4, 4), false);
}

#[test]
fn sdpa_gradcheck() {
    for causal in [false, true] {
        for t in [1, 7, 65] {
            let d = if t == 65 { 2 } else { 4 };
            let shape = vec![1, t, d];
            let n = t * d;
            gradcheck(
                &format!("sdpa t {t} causal {causal}"),
                &[
                    (shape.clone(), values_in(n, -1.0, 1.0, 1)),
                    (shape.clone(), values_in(n, -1.0, 1.0, 2)),
                    (shape, values_in(n, -1.0, 1.0, 3)),
                ],
                |x| x[0].scaled_dot_product_attention(&x[1], &x[2], causal),
            );
        }
    }
}

#[test]
fn sdpa_keeps_batch_dims_and_reads_views() {
    let (q, _) = random_tensor(&[2, 3, 5, 4], 5);
    let (k, _) = random_tensor(&[2, 3, 6, 4], 6);
    let (v, _) = random_tensor(&[2, 3, 6, 2], 7);
    let out = q.scaled_dot_product_attention(&k, &v, false).unwrap();
    assert_eq!(out.shape(), &[2, 3, 5, 2]);
    // A transposed view of the heads gives the same rows, transposed back.
    let qt = q.transpose(0, 1).unwrap();
    let kt = k.transpose(0, 1).unwrap();
    let vt = v.transpose(0, 1).unwrap();
    let out_t = qt.scaled_dot_product_attention(&kt, &vt, false).unwrap();
    let back = out_t.transpose(0, 1).unwrap().to_vec().unwrap();
    let want: Vec<f64> = out.to_vec().unwrap().iter().map(|&x| x as f64).collect();
    assert_close(&back, &want, 1e-5, "sdpa of transposed views");
}

#[test]
fn sdpa_rejects_mismatched_shapes() {
    let dev = device();
    let t = |s: &[usize]| Tensor::zeros(s, dev).unwrap();
    let cases = [
        (t(&[2, 5, 4]), t(&[2, 5, 3]), t(&[2, 5, 4])), // D differs
        (t(&[2, 5, 4]), t(&[3, 5, 4]), t(&[3, 5, 4])), // batch dims differ
        (t(&[2, 5, 4]), t(&[2, 5, 4]), t(&[2, 6, 4])), // k and v lengths differ
        (t(&[4]), t(&[4]), t(&[4])),                   // rank 1
        (t(&[1, 2, 300]), t(&[1, 2, 300]), t(&[1, 2, 4])), // too wide
    ];
    for (q, k, v) in cases {
        match q.scaled_dot_product_attention(&k, &v, false) {
            Err(e @ Error::Shape { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("scaled_dot_product_attention"), "{msg}");
                assert!(msg.contains(&format!("{:?}", q.shape())), "{msg}");
            }
            other => panic!(
                "expected a shape error, got {:?}",
                other.map(|t| t.shape().to_vec())
            ),
        }
    }
}

/// Heads cut from one packed q|k|v projection, as MultiheadAttention makes them, are read in
/// place (strided rows, offsets not multiples of 4) and give what contiguous copies give.
#[test]
fn sdpa_reads_heads_of_a_packed_projection_in_place() {
    let (b, t, heads, dh) = (2, 5, 3, 6);
    let c = heads * dh;
    let (qkv, _) = random_tensor(&[b, t, 3 * c], 8);
    let head = |i: usize| {
        qkv.narrow(2, i * c, c)
            .unwrap()
            .reshape(&[b, t, heads, dh])
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    };
    let (q, k, v) = (head(0), head(1), head(2));
    let got = q
        .scaled_dot_product_attention(&k, &v, true)
        .unwrap()
        .to_vec()
        .unwrap();
    let dense = |x: &Tensor| x.contiguous().unwrap();
    let want: Vec<f64> = dense(&q)
        .scaled_dot_product_attention(&dense(&k), &dense(&v), true)
        .unwrap()
        .to_vec()
        .unwrap()
        .iter()
        .map(|&x| x as f64)
        .collect();
    assert_close(&got, &want, 1e-5, "heads of a packed projection");
}

/// q, k and v `[B, heads, T, C / heads]` split from a packed `[B, T, 3 C]` projection, as
/// MultiheadAttention makes them (views).
fn heads_of_packed(qkv: &Tensor, heads: usize) -> Vec<Tensor> {
    let &[b, t, c3] = qkv.shape() else {
        panic!("a [B, T, 3 C] projection")
    };
    let c = c3 / 3;
    qkv.split(&[c, c, c], 2)
        .unwrap()
        .iter()
        .map(|p| {
            p.reshape(&[b, t, heads, c / heads])
                .unwrap()
                .transpose(1, 2)
                .unwrap()
        })
        .collect()
}

/// Heads split from a packed projection, as MultiheadAttention makes them: the output is laid
/// out as q is ([B, T, H, D] in memory), so merging its heads back is a view, and the grads
/// of the packed projection equal those through contiguous copies.
#[test]
fn sdpa_output_and_grads_follow_the_inputs_layout() {
    let (b, t, heads, dh) = (2, 7, 2, 4);
    let c = heads * dh;
    let (values, _) = random_tensor(&[b, t, 3 * c], 9);
    let values = values.to_vec().unwrap();
    let run = |dense: bool| -> (Vec<f32>, Vec<f32>, bool) {
        let qkv = Tensor::from_slice(&values, &[b, t, 3 * c], device())
            .unwrap()
            .requires_grad_(true);
        let parts: Vec<Tensor> = heads_of_packed(&qkv, heads)
            .into_iter()
            .map(|h| if dense { h.contiguous().unwrap() } else { h })
            .collect();
        let out = parts[0]
            .scaled_dot_product_attention(&parts[1], &parts[2], true)
            .unwrap();
        let merged = out.transpose(1, 2).unwrap().reshape(&[b, t, c]).unwrap();
        let is_view = merged.storage_id() == out.storage_id();
        let (weights, _) = random_tensor(&[b, t, c], 10);
        merged
            .mul(&weights)
            .unwrap()
            .sum()
            .unwrap()
            .backward()
            .unwrap();
        (
            merged.to_vec().unwrap(),
            qkv.grad().unwrap().to_vec().unwrap(),
            is_view,
        )
    };
    let (out, grad, is_view) = run(false);
    let (want_out, want_grad, _) = run(true);
    assert!(is_view, "merging the heads of the output copied it");
    let as_f64 = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    assert_close(&out, &as_f64(&want_out), 1e-5, "output");
    assert_close(
        &grad,
        &as_f64(&want_grad),
        1e-5,
        "grad of the packed projection",
    );
}

/// q, k and v that are one tensor share every element: their grads must not share a
/// buffer, and the tensor's grad is the sum of the three.
#[test]
fn sdpa_of_one_tensor_as_q_k_and_v_sums_its_three_grads() {
    let (b, heads, t, d) = (2, 2, 5, 4);
    let values = random_vec(b * heads * t * d, 13);
    let run = |copies: bool| -> Vec<f32> {
        let x = Tensor::from_slice(&values, &[b, heads, t, d], device())
            .unwrap()
            .requires_grad_(true);
        let side = |_| {
            if copies {
                x.mul_scalar(1.0).unwrap()
            } else {
                x.clone()
            }
        };
        let (q, k, v) = (side(0), side(1), side(2));
        let out = q.scaled_dot_product_attention(&k, &v, true).unwrap();
        let (weights, _) = random_tensor(&[b, heads, t, d], 14);
        out.mul(&weights)
            .unwrap()
            .sum()
            .unwrap()
            .backward()
            .unwrap();
        x.grad().unwrap().to_vec().unwrap()
    };
    let want: Vec<f64> = run(true).iter().map(|&x| x as f64).collect();
    assert_close(&run(false), &want, 1e-5, "grad of x as q, k and v");
}

#[test]
fn sdpa_of_views_launches_no_copies() {
    // A device of its own: the dispatch counter is shared by every test on a device.
    let dev = Device::new().unwrap();
    let (b, t, heads, dh) = (2, 8, 2, 4);
    let c = heads * dh;
    let qkv = Tensor::from_slice(&random_vec(b * t * 3 * c, 11), &[b, t, 3 * c], &dev)
        .unwrap()
        .requires_grad_(true);
    let parts = heads_of_packed(&qkv, heads);
    dev.synchronize().unwrap();
    let before = dev.stats().dispatches;
    let out = parts[0]
        .scaled_dot_product_attention(&parts[1], &parts[2], false)
        .unwrap();
    let merged = out.transpose(1, 2).unwrap().reshape(&[b, t, c]).unwrap();
    dev.synchronize().unwrap();
    // The forward kernel alone: q, k, v read in place, the output written in q's order.
    assert_eq!(dev.stats().dispatches - before, 1);
    let weights = Tensor::from_slice(&random_vec(b * t * c, 12), &[b, t, c], &dev).unwrap();
    let loss = merged.mul(&weights).unwrap().sum().unwrap();
    dev.synchronize().unwrap();
    let before = dev.stats().dispatches;
    loss.backward().unwrap();
    dev.synchronize().unwrap();
    let backward = dev.stats().dispatches - before;
    // The root's ones, mul's backward (two launches), the row stats (log-sum-exp and delta),
    // the query and the key kernels: no copy of a head permute, and no cat of the three
    // grads in split's backward (the kernels write them where the packed projection's grad
    // has them, and split joins them as a view).
    assert_eq!(backward, 6, "the backward took {backward} dispatches");
}

/// The split paths (a forward joined by `combine`, backward launches per span) write through
/// the inputs' layouts too: heads read from `[T, H, D]` memory give what contiguous heads give.
#[test]
fn sdpa_split_paths_write_in_the_inputs_layout() {
    let (heads, tq, tk, d) = (2, 3, 12_000, 4);
    let memory = |t: usize, seed: u64| {
        let (x, _) = random_tensor(&[t, heads, d], seed);
        x.requires_grad_(true)
    };
    for long_keys in [true, false] {
        let (tq, tk) = if long_keys { (tq, tk) } else { (tk, tq) };
        let (q, k, v, g) = (
            memory(tq, 21),
            memory(tk, 22),
            memory(tk, 23),
            memory(tq, 24),
        );
        let heads_of = |x: &Tensor| x.transpose(0, 1).unwrap();
        let run = |dense: bool| -> Vec<Vec<f32>> {
            let view = |x: &Tensor| {
                let h = heads_of(x);
                if dense {
                    h.contiguous().unwrap()
                } else {
                    h
                }
            };
            let out = view(&q)
                .scaled_dot_product_attention(&view(&k), &view(&v), false)
                .unwrap();
            let grads = wgrad::autograd::grad(
                std::slice::from_ref(&out),
                &[q.clone(), k.clone(), v.clone()],
                Some(&[heads_of(&g).detach()]),
                false,
            )
            .unwrap();
            std::iter::once(out.to_vec().unwrap())
                .chain(grads.iter().map(|g| g.as_ref().unwrap().to_vec().unwrap()))
                .collect()
        };
        let (got, want) = (run(false), run(true));
        for (what, (got, want)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
            assert_close(got, &want, 1e-5, &format!("{what}, long keys {long_keys}"));
        }
    }
}

/// No query rows, or no key rows: empty outputs and grads of the inputs' shapes (zeros where
/// there is nothing to attend to), forward and backward, no error.
#[test]
fn sdpa_with_no_rows_on_either_side_gives_empty_or_zero_results() {
    let dev = device();
    for (b, tq, tk) in [(2, 0, 3), (2, 3, 0), (2, 0, 0), (0, 3, 3)] {
        let q = Tensor::zeros(&[b, tq, 4], dev)
            .unwrap()
            .requires_grad_(true);
        let k = Tensor::ones(&[b, tk, 4], dev).unwrap().requires_grad_(true);
        let v = Tensor::ones(&[b, tk, 4], dev).unwrap().requires_grad_(true);
        let out = q.scaled_dot_product_attention(&k, &v, false).unwrap();
        assert_eq!(out.shape(), &[b, tq, 4]);
        assert!(
            out.to_vec().unwrap().iter().all(|&x| x == 0.0),
            "tq {tq} tk {tk}"
        );
        out.sum().unwrap().backward().unwrap();
        for (t, n) in [(&q, tq), (&k, tk), (&v, tk)] {
            let grad = t.grad().unwrap();
            assert_eq!(grad.shape(), &[b, n, 4]);
            assert!(
                grad.to_vec().unwrap().iter().all(|&x| x == 0.0),
                "tq {tq} tk {tk}"
            );
        }
    }
}

/// An empty view past its buffer's start (no batch rows of a view at an offset) spans
/// nothing: an empty result, not an overflow.
#[test]
fn sdpa_of_an_empty_view_at_an_offset_gives_an_empty_result() {
    let dev = device();
    let x = Tensor::ones(&[3, 5, 4], dev).unwrap();
    let y = x.narrow(1, 2, 3).unwrap().narrow(0, 1, 0).unwrap();
    let out = y.scaled_dot_product_attention(&y, &y, true).unwrap();
    assert_eq!(out.shape(), &[0, 3, 4]);
}

/// Views whose rows are followed by NaN (the last feature of each row left out, holding NaN)
/// give the values and grads of the same rows read dense: the kernels zero the features past
/// a row's end by selecting, where multiplying by 0 would have turned NaN into NaN.
#[test]
fn sdpa_of_views_ignores_nan_past_the_end_of_each_row() {
    let dev = device();
    let (heads, tq, tk, d, dv) = (2, 3, 5, 3, 2);
    // `rows` rows of `width` random features, each followed by one NaN; and the features.
    let padded = |rows: usize, width: usize, seed| {
        let values = random_vec(rows * width, seed);
        let mut stored = Vec::new();
        for row in values.chunks(width) {
            stored.extend_from_slice(row);
            stored.push(f32::NAN);
        }
        let t = Tensor::from_slice(&stored, &[heads, rows / heads, width + 1], dev).unwrap();
        (t.requires_grad_(true), values)
    };
    let (q_stored, qv) = padded(heads * tq, d, 11);
    let (k_stored, kv) = padded(heads * tk, d, 12);
    let (v_stored, vv) = padded(heads * tk, dv, 13);
    let (g_stored, gv) = padded(heads * tq, dv, 14);
    let features = |t: &Tensor, n: usize| t.narrow(2, 0, n).unwrap();
    let out = features(&q_stored, d)
        .scaled_dot_product_attention(&features(&k_stored, d), &features(&v_stored, dv), true)
        .unwrap();
    out.backward_with(BackwardOptions {
        grad_output: Some(features(&g_stored.detach(), dv)),
        ..Default::default()
    })
    .unwrap();
    // Each head's reference, and the grads padded as the stored tensors are (0 at the NaN).
    let mut want: [Vec<f64>; 4] = Default::default();
    for h in 0..heads {
        let r = reference(
            &qv[h * tq * d..(h + 1) * tq * d],
            &kv[h * tk * d..(h + 1) * tk * d],
            &vv[h * tk * dv..(h + 1) * tk * dv],
            &gv[h * tq * dv..(h + 1) * tq * dv],
            (tq, tk, d, dv),
            true,
        );
        want[0].extend(r.0);
        for (i, (grad, width)) in [(r.1, d), (r.2, d), (r.3, dv)].into_iter().enumerate() {
            for row in grad.chunks(width) {
                want[i + 1].extend_from_slice(row);
                want[i + 1].push(0.0);
            }
        }
    }
    assert_close(&out.to_vec().unwrap(), &want[0], 1e-4, "out");
    for (name, stored, want) in [
        ("dq", &q_stored, &want[1]),
        ("dk", &k_stored, &want[2]),
        ("dv", &v_stored, &want[3]),
    ] {
        assert_close(&stored.grad().unwrap().to_vec().unwrap(), want, 1e-3, name);
    }
}
