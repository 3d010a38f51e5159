//! The capture fuser: runs of elementwise launches become one generated kernel (validated by
//! naga before use), whose results equal the unfused launches'.

mod common;
use common::*;
use wgrad::capture::Step;
use wgrad::optim::{AdamConfig, AdamW, Optimizer, Sgd, SgdConfig};
use wgrad::{Result, Tensor};

/// Runs `f` eagerly, then captured (eager, capture, replay), and returns the eager result,
/// the replayed one, and the step's stats.
fn eager_and_replayed(
    inputs: &[Tensor],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> (Vec<f32>, Vec<f32>, wgrad::capture::StepStats) {
    let want = f(inputs).unwrap().to_vec().unwrap();
    let mut step = Step::new(|b: &[Tensor]| f(b));
    let mut got = Vec::new();
    for _ in 0..3 {
        got = step.run(inputs).unwrap().to_vec().unwrap();
    }
    assert_eq!(step.stats().replays, 1);
    (want, got, step.stats())
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let same = (x - y).abs() <= 1e-6 * x.abs().max(1.0) || (x.is_nan() && y.is_nan());
        assert!(same, "{what}[{i}]: fused {y} vs unfused {x}");
    }
}

#[test]
fn a_chain_of_elementwise_ops_becomes_one_kernel() {
    let (a, _) = random_tensor(&[1000], 1);
    let (b, _) = random_tensor(&[1000], 2);
    let chain = |t: &[Tensor]| -> Result<Tensor> {
        t[0].mul(&t[1])?
            .add(&t[0])?
            .relu()?
            .mul_scalar(0.5)?
            .tanh()?
            .sub(&t[1])
    };
    let (want, got, stats) = eager_and_replayed(&[a, b], chain);
    assert_close(&want, &got, "chain");
    assert_eq!(stats.replay_dispatches, 1, "{stats:?}");
    assert_eq!(stats.fused_away, 5);
}

#[test]
fn a_fused_replay_records_one_dispatch_on_the_device() {
    // A device of its own, so other tests' dispatches do not count.
    let dev = wgrad::Device::new().unwrap();
    let a = Tensor::from_vec(random_vec(4096, 3), &[64, 64], &dev).unwrap();
    let b = Tensor::from_vec(random_vec(4096, 4), &[64, 64], &dev).unwrap();
    let mut step = Step::new(|t: &[Tensor]| t[0].mul(&t[1])?.add(&t[0])?.relu());
    for _ in 0..2 {
        step.run(&[a.clone(), b.clone()]).unwrap();
    }
    dev.synchronize().unwrap();
    let before = dev.stats().dispatches;
    step.run(&[a, b]).unwrap();
    assert_eq!(dev.stats().dispatches - before, 1);
}

#[test]
fn unfused_plans_run_every_launch() {
    let (a, _) = random_tensor(&[256], 5);
    let mut step = Step::new(|t: &[Tensor]| t[0].exp()?.neg()?.abs()).with_fusion(false);
    for _ in 0..3 {
        step.run(std::slice::from_ref(&a)).unwrap();
    }
    assert_eq!(
        (step.stats().replay_dispatches, step.stats().fused_away),
        (3, 0)
    );
}

#[test]
fn every_unary_op_fuses_and_matches() {
    let (a, _) = random_tensor(&[37], 6); // odd: the scalar path
    let ops = |t: &[Tensor]| -> Result<Tensor> {
        let x = &t[0];
        let parts = [
            x.neg()?,
            x.abs()?.add_scalar(0.1)?.log()?,
            x.exp()?,
            x.relu()?,
            x.tanh()?,
            x.sigmoid()?,
            x.gelu()?,
            x.abs()?.sqrt()?,
            x.abs()?.powf(1.5)?,
            x.sub_scalar(0.25)?.div_scalar(3.0)?,
            x.sign()?,
            x.erf()?,
            x.clamp(-0.3, 0.4)?,
        ];
        let mut sum = parts[0].clone();
        for p in &parts[1..] {
            sum = sum.add(p)?;
        }
        Ok(sum)
    };
    let (want, got, stats) = eager_and_replayed(&[a], ops);
    assert_close(&want, &got, "unary ops");
    assert!(stats.replay_dispatches <= 2, "{stats:?}");
}

#[test]
fn every_binary_op_fuses_and_matches() {
    let (a, _) = random_tensor(&[8, 12], 7);
    let (b, _) = random_tensor(&[8, 12], 8);
    let ops = |t: &[Tensor]| -> Result<Tensor> {
        let (x, y) = (&t[0], &t[1]);
        x.add(y)?
            .sub(&x.mul(y)?)?
            .add(&x.div(&y.abs()?.add_scalar(1.0)?)?)?
            .add(&x.maximum(y)?)
    };
    let (want, got, stats) = eager_and_replayed(&[a, b], ops);
    assert_close(&want, &got, "binary ops");
    assert!(stats.replay_dispatches <= 2, "{stats:?}");
}

#[test]
fn broadcast_and_strided_operands_fuse_and_match() {
    let (x, _) = random_tensor(&[6, 10], 9);
    let (bias, _) = random_tensor(&[10], 10);
    let (other, _) = random_tensor(&[10, 6], 11);
    let f = |t: &[Tensor]| -> Result<Tensor> {
        // A bias row repeated down the rows, and a transposed (strided) operand.
        t[0].add(&t[1])?.relu()?.mul(&t[2].t()?)?.add_scalar(1.0)
    };
    let (want, got, stats) = eager_and_replayed(&[x, bias, other], f);
    assert_close(&want, &got, "broadcast");
    assert_eq!(stats.replay_dispatches, 1, "{stats:?}");
}

#[test]
fn values_used_after_the_group_are_written_too() {
    let (a, _) = random_tensor(&[64], 12);
    // `h` feeds the fused chain and a reduction after it.
    let f = |t: &[Tensor]| -> Result<Tensor> {
        let h = t[0].mul_scalar(2.0)?.relu()?;
        let y = h.add_scalar(1.0)?.mul(&h)?;
        y.sum()?.add(&h.sum()?)
    };
    let (want, got, _) = eager_and_replayed(&[a], f);
    assert_close(&want, &got, "two outputs");
}

#[test]
fn a_bias_add_and_activation_run_in_the_matmuls_stores() {
    // N a multiple of 4: each store is a vec4, the bias read a vec4 at a time.
    let (x, _) = random_tensor(&[8, 12], 13);
    let (w, _) = random_tensor(&[12, 16], 14);
    let (bias, _) = random_tensor(&[16], 15);
    let f = |t: &[Tensor]| t[0].matmul(&t[1])?.add(&t[2])?.relu();
    let (want, got, stats) = eager_and_replayed(&[x, w, bias], f);
    assert_close(&want, &got, "x w + bias, relu");
    assert_eq!(stats.replay_dispatches, 1, "{stats:?}");
    assert_eq!(stats.fused_away, 2);
}

#[test]
fn an_epilogue_stores_element_by_element_where_n_is_not_a_multiple_of_4() {
    let (x, _) = random_tensor(&[3, 5], 16);
    let (w, _) = random_tensor(&[5, 10], 17);
    let (bias, _) = random_tensor(&[10], 18);
    let f = |t: &[Tensor]| t[0].matmul(&t[1])?.add(&t[2])?.gelu();
    let (want, got, stats) = eager_and_replayed(&[x, w, bias], f);
    assert_close(&want, &got, "x w + bias, gelu");
    assert_eq!(stats.replay_dispatches, 1, "{stats:?}");
}

#[test]
fn an_epilogue_reads_residual_and_strided_operands() {
    let (x, _) = random_tensor(&[8, 8], 19);
    let (w, _) = random_tensor(&[8, 8], 20);
    let (other, _) = random_tensor(&[8, 8], 21);
    // A residual (dense, same shape) and a transposed operand (read through strides).
    let f = |t: &[Tensor]| t[0].add(&t[0].matmul(&t[1])?)?.mul(&t[2].t()?);
    let (want, got, stats) = eager_and_replayed(&[x, w, other], f);
    assert_close(&want, &got, "x + x w, times other^T");
    assert_eq!(stats.replay_dispatches, 1, "{stats:?}");
}

#[test]
fn a_narrow_products_bias_add_runs_in_its_stores() {
    // A classifier head: 6 outputs for 100 rows is computed transposed and read through a
    // transposed view; the bias add still runs in the matmul's stores.
    let (x, _) = random_tensor(&[100, 20], 38);
    let (w, _) = random_tensor(&[6, 20], 39);
    let (bias, _) = random_tensor(&[6], 40);
    let f = |t: &[Tensor]| t[0].matmul(&t[1].t()?)?.add(&t[2])?.relu();
    let (want, got, stats) = eager_and_replayed(&[x, w, bias], f);
    assert_close(&want, &got, "x w^T + bias, relu");
    assert_eq!(stats.replay_dispatches, 1, "{stats:?}");
}

#[test]
fn an_epilogue_also_writes_a_product_read_after_it() {
    let (a, _) = random_tensor(&[4, 8], 22);
    let (b, _) = random_tensor(&[8, 8], 23);
    // The reduction after the relu reads the product too: the epilogue writes both.
    let f = |t: &[Tensor]| -> Result<Tensor> {
        let p = t[0].matmul(&t[1])?;
        let r = p.relu()?;
        r.add(&p.sum()?)
    };
    let (want, got, stats) = eager_and_replayed(&[a, b], f);
    assert_close(&want, &got, "relu(p) + sum(p)");
    // matmul + relu, sum, add.
    assert_eq!(stats.replay_dispatches, 3, "{stats:?}");
}

#[test]
fn a_product_read_before_the_group_ends_keeps_its_own_launch() {
    let (a, _) = random_tensor(&[4, 8], 24);
    let (b, _) = random_tensor(&[8, 8], 25);
    // The sum runs between the product and its relu: moving the product later would leave
    // the sum reading nothing.
    let f = |t: &[Tensor]| -> Result<Tensor> {
        let p = t[0].matmul(&t[1])?;
        let s = p.sum()?;
        p.relu()?.add(&s)
    };
    let (want, got, stats) = eager_and_replayed(&[a, b], f);
    assert_close(&want, &got, "relu(p) + sum(p)");
    // matmul, sum, relu + add.
    assert_eq!(stats.replay_dispatches, 3, "{stats:?}");
}

/// Runs `steps` optimizer steps over twin sets of parameters of odd sizes (grads set once),
/// eagerly and captured; checks the parameters agree and returns the captured step's stats.
fn optimizer_steps(
    make: impl Fn(Vec<Tensor>) -> Box<dyn Optimizer>,
    steps: usize,
) -> wgrad::capture::StepStats {
    let sizes = [3, 8, 5, 16, 1, 7];
    let leaves = |seed: u64| -> Vec<Tensor> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let (t, _) = random_tensor(&[n], seed + i as u64);
                let t = t.requires_grad_(true);
                let (g, _) = random_tensor(&[n], 100 + i as u64);
                t.set_grad(Some(g)).unwrap();
                t
            })
            .collect()
    };
    let (eager, captured) = (leaves(30), leaves(30));
    let mut eager_opt = make(eager.clone());
    let mut opt = make(captured.clone());
    let mut step = Step::new(|t: &[Tensor]| {
        opt.step()?;
        Ok(t[0].clone())
    });
    let (x, _) = random_tensor(&[1], 7);
    for _ in 0..steps {
        eager_opt.step().unwrap();
        step.run(std::slice::from_ref(&x)).unwrap();
    }
    for (a, b) in eager.iter().zip(&captured) {
        assert_close(&a.to_vec().unwrap(), &b.to_vec().unwrap(), "parameter");
    }
    step.stats()
}

#[test]
fn an_adam_step_over_many_parameters_runs_as_one_or_two_launches() {
    let config = AdamConfig {
        weight_decay: 0.01,
        ..AdamConfig::default()
    };
    let stats = optimizer_steps(|p| Box::new(AdamW::new(p, config)), 5);
    // Six parameters, four buffers each: one launch where a kernel may bind 32 storage
    // buffers (Vulkan), two where it may bind 16 (GL).
    assert!(stats.replay_dispatches <= 2, "{stats:?}");
    assert_eq!(
        stats.replay_dispatches + stats.fused_away as u64,
        6,
        "{stats:?}"
    );
}

#[test]
fn merged_sgd_steps_equal_eager_steps() {
    let momentum = SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        nesterov: true,
        weight_decay: 1e-3,
        ..SgdConfig::default()
    };
    for config in [momentum, SgdConfig::default()] {
        let stats = optimizer_steps(|p| Box::new(Sgd::new(p, config)), 4);
        assert!(stats.replay_dispatches <= 2, "{stats:?}");
    }
}

#[test]
fn the_ops_after_a_layer_norm_run_in_its_stores() {
    let (x, _) = random_tensor(&[6, 10], 26);
    let (weight, _) = random_tensor(&[10], 27);
    let (bias, _) = random_tensor(&[10], 28);
    let (residual, _) = random_tensor(&[6, 10], 29);
    let f = |t: &[Tensor]| t[0].layer_norm(&t[1], &t[2], 1e-5)?.gelu()?.add(&t[3]);
    let (want, got, stats) = eager_and_replayed(&[x, weight, bias, residual], f);
    assert_close(&want, &got, "gelu(layer_norm(x)) + residual");
    assert_eq!(stats.replay_dispatches, 1, "{stats:?}");
}

#[test]
fn a_layer_norm_backward_adds_the_residual_grad_in_its_stores() {
    // x feeds a LayerNorm and, as a residual stream does, the loss directly: its grad is the
    // LayerNorm's input grad plus the direct one, added in the backward kernel's stores.
    let (x, _) = random_tensor(&[70, 12], 41);
    let (weight, _) = random_tensor(&[12], 42);
    let (bias, _) = random_tensor(&[12], 43);
    let (c, _) = random_tensor(&[70, 12], 44);
    let (d, _) = random_tensor(&[70, 12], 45);
    let grads = |t: &[Tensor]| -> Result<Tensor> {
        let x = t[0].detach().requires_grad_(true);
        let y = x.layer_norm(&t[1], &t[2], 1e-5)?.mul(&t[3])?;
        let loss = y.add(&x.mul(&t[4])?)?.sum()?;
        let dx = wgrad::autograd::grad(&[loss], &[x], None, false)?;
        Ok(dx[0].clone().expect("x is used"))
    };
    let (want, got, stats) = eager_and_replayed(&[x, weight, bias, c, d], grads);
    assert_close(&want, &got, "the grad of x");
    // The add runs in the backward kernel's stores, not in a launch of its own. (The weight
    // and bias take no grad, so no launch sums theirs; the loss's sum is two passes of chunks
    // on the CPU flavour, one of a workgroup per row on the GPU flavour.)
    let want_dispatches = match device().kernel_flavor() {
        wgrad::KernelFlavor::Cpu => 7,
        _ => 6,
    };
    assert_eq!(stats.replay_dispatches, want_dispatches, "{stats:?}");
}

#[test]
fn consecutive_reductions_run_as_one_launch() {
    let (a, _) = random_tensor(&[64, 16], 31);
    let (b, _) = random_tensor(&[64, 16], 32);
    let (c, _) = random_tensor(&[64, 16], 33);
    // Three column sums, as a backward pass takes the bias and norm-weight grads.
    let f = |t: &[Tensor]| -> Result<Tensor> {
        let sums: Vec<Tensor> = t
            .iter()
            .map(|x| x.sum_dims(&[0], false))
            .collect::<Result<_>>()?;
        sums[0].add(&sums[1])?.mul(&sums[2])
    };
    let (want, got, stats) = eager_and_replayed(&[a, b, c], f);
    assert_close(&want, &got, "column sums");
    // One merged reduction and one fused add + mul. The GPU flavour (a GPU, or
    // WGRAD_KERNEL_FLAVOR=gpu) sums each row in a workgroup of its own, which does not merge:
    // three sums and the fused add + mul.
    let want_dispatches = match device().kernel_flavor() {
        wgrad::KernelFlavor::Cpu => 2,
        wgrad::KernelFlavor::Gpu => 4,
    };
    assert_eq!(stats.replay_dispatches, want_dispatches, "{stats:?}");
}

#[test]
fn two_pass_reductions_merge_pass_by_pass() {
    // Long columns are summed in two passes, the second reading the first's partial sums:
    // the first passes of both sums run as one launch, then both second passes.
    let (a, _) = random_tensor(&[1024, 8], 36);
    let (b, _) = random_tensor(&[1024, 8], 37);
    let f = |t: &[Tensor]| {
        t[0].sum_dims(&[0], false)?
            .add(&t[1].sum_dims(&[0], false)?)
    };
    let (want, got, stats) = eager_and_replayed(&[a, b], f);
    assert_close(&want, &got, "two column sums");
    assert_eq!(stats.replay_dispatches, 3, "{stats:?}");
}

#[test]
fn two_optimizers_keep_their_own_step_counts_when_merged() {
    // Two Adam optimizers (as a model's decayed and undecayed groups): each advances its step
    // count in a host hook before its updates; merging must not move the second optimizer's
    // updates ahead of its hook.
    let leaves = |seed: u64| -> Vec<Tensor> {
        (0..4)
            .map(|i| {
                let (t, _) = random_tensor(&[6], seed + i);
                let t = t.requires_grad_(true);
                let (g, _) = random_tensor(&[6], 200 + i);
                t.set_grad(Some(g)).unwrap();
                t
            })
            .collect()
    };
    let config = AdamConfig::default();
    let (eager, captured) = (leaves(40), leaves(40));
    let mut eager_opts = [
        AdamW::new(eager[..2].to_vec(), config),
        AdamW::new(eager[2..].to_vec(), config),
    ];
    let mut opts = [
        AdamW::new(captured[..2].to_vec(), config),
        AdamW::new(captured[2..].to_vec(), config),
    ];
    let mut step = Step::new(|t: &[Tensor]| {
        opts[0].step()?;
        opts[1].step()?;
        Ok(t[0].clone())
    });
    let (x, _) = random_tensor(&[1], 8);
    for _ in 0..4 {
        eager_opts.iter_mut().for_each(|o| o.step().unwrap());
        step.run(std::slice::from_ref(&x)).unwrap();
    }
    assert_eq!(step.stats().replays, 2);
    for (a, b) in eager.iter().zip(&captured) {
        assert_close(&a.to_vec().unwrap(), &b.to_vec().unwrap(), "parameter");
    }
}

#[test]
fn each_pass_reports_the_commands_it_removed() {
    // An MLP training step: grads installed into empty slots (copies), bias adds and ReLUs
    // (fused), AdamW's updates and the bias grads' column sums (merged).
    let stats_with = |fusion: bool| {
        let dev = device();
        let model = wgrad::nn::Sequential::new()
            .add(wgrad::nn::Linear::new(12, 16, true, dev).unwrap())
            .add(wgrad::nn::Relu)
            .add(wgrad::nn::Linear::new(16, 3, true, dev).unwrap());
        use wgrad::nn::Module;
        let mut opt = AdamW::new(model.parameters(), AdamConfig::default());
        let mut step = Step::new(|b: &[Tensor]| {
            opt.zero_grad();
            let loss = wgrad::nn::loss::cross_entropy(&model.forward(&b[0])?, &b[1])?;
            loss.backward()?;
            opt.step()?;
            Ok(loss)
        })
        .with_fusion(fusion);
        let (x, _) = random_tensor(&[8, 12], 51);
        let y = Tensor::from_labels(vec![0, 1, 2, 0, 1, 2, 0, 1], dev).unwrap();
        for _ in 0..3 {
            step.run(&[x.clone(), y.clone()]).unwrap();
        }
        step.stats()
    };
    let (fused, unfused) = (stats_with(true), stats_with(false));
    let passes = fused.passes;
    assert!(passes.copies_forwarded > 0, "{fused:?}");
    assert!(passes.epilogues > 0 && passes.merged > 0, "{fused:?}");
    assert_eq!(
        fused.fused_away,
        passes.epilogues + passes.fused + passes.merged
    );
    assert_eq!(unfused.passes, wgrad::capture::PassStats::default());
    // Forwarded copies are buffer copies, not dispatches: the launches the fused plan lacks
    // are those the other passes removed.
    let removed = unfused.replay_dispatches - fused.replay_dispatches;
    assert_eq!(
        removed,
        (passes.epilogues + passes.fused + passes.merged) as u64,
        "{fused:?} {unfused:?}"
    );
}
