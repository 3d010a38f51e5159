//! Fusion: passes over a captured plan that make it fewer, fuller launches.
//!
//! On software adapters an elementwise kernel is bound by instructions per load and every
//! launch has a fixed cost, so the only way past them is fewer passes over memory and fewer
//! launches. Three passes, each producing kernels validated with naga before they are compiled
//! (one that fails leaves its launches as they were):
//!
//! - **Elementwise runs** ([`fuse`]): launches that describe themselves as elementwise (unary
//!   and binary ops, backward rules, `accumulate_grad`'s clone-then-add) over the same output
//!   shape join a group while each reads the group's earlier results in place (same element,
//!   no view). Values only the group uses stay in registers; the rest are written. A launch
//!   between members that touches none of the group's values stays where it is, before the
//!   fused kernel, which takes the place of the group's last member.
//! - **Epilogues** (in [`fuse`]): a group whose first member reads, in place, the output of a
//!   launch with an `EPILOGUE SECTION` (matmul, LayerNorm's forward) runs in that launch's
//!   stores instead: the section is replaced by stores that compute the group's values from
//!   the one in the register. The launch moves to the group's last member, so it may only move
//!   past launches that neither write what it reads nor touch what else it writes.
//! - **Merged parts** ([`merge_parts`]): consecutive launches of one pipeline whose entry point
//!   runs a function of its module's `MEMBER SECTION` (an optimizer's update of each parameter,
//!   serial reductions) become one launch with a copy of the section per member, each with its
//!   own names, bindings and param block, over workgroups of its own.

use std::collections::{HashMap, HashSet};
use std::fmt::Write;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::capture::plan::{Command, Draft, Launch};
use crate::device::{declared_bindings, Device, PipelineSource, GENERATED};
use crate::kernel::{
    groups, Elementwise, EpilogueSite, Fusion, MergeSite, COMMON_WGSL, CONTIGUOUS_PER_GROUP,
    MAX_SLOTS,
};
use crate::tensor::layout::row_major_strides;
use crate::tensor::tape::HostBytes;
use crate::tensor::Layout;

/// The most launches one fused kernel takes in.
const MAX_MEMBERS: usize = 32;

/// A run of elementwise launches being gathered.
#[derive(Clone)]
struct Group {
    members: Vec<usize>,
    shape: Vec<usize>,
    /// Values the members write, in order.
    produced: Vec<usize>,
    /// Values the members read from memory.
    read: HashSet<usize>,
}

impl Group {
    fn touches(&self, value: usize) -> bool {
        self.read.contains(&value) || self.produced.contains(&value)
    }
}

/// Reads the element at the output's own index: how a member may read an earlier member's
/// result from a register.
fn reads_in_place(layout: &Layout, shape: &[usize]) -> bool {
    layout.shape == shape && layout.offset == 0 && layout.strides == row_major_strides(shape)
}

fn launch_values(command: &Command) -> Vec<usize> {
    command.buffers().into_iter().copied().collect()
}

/// Whether launch `l` may write `value`: bound where its module declares `read_write`.
fn launch_writes(l: &Launch, value: usize) -> bool {
    l.bindings
        .iter()
        .any(|&(b, v)| v == value && l.pipeline.writable.contains(&b))
}

/// Whether `command` may write `value`.
fn writes(command: &Command, value: usize) -> bool {
    match command {
        Command::Launch(l) => launch_writes(l, value),
        Command::Upload(upload) => upload.target == value,
        Command::Copy(copy) => copy.dst.0 == value,
        Command::Hook(_) => false,
    }
}

/// Removes copies of a whole intermediate into a value the step makes and nothing used
/// before (`accumulate_grad` of an empty slot copies the engine's new grad into the grad it
/// installs): the launches that wrote and read the intermediate use the copy's target
/// instead. Returns how many copies it removed.
pub(crate) fn forward_copies(draft: &mut Draft) -> usize {
    let mut removed = 0;
    let mut at = 0;
    while at < draft.commands.len() {
        let Command::Copy(copy) = &draft.commands[at] else {
            at += 1;
            continue;
        };
        let (src, dst) = (copy.src.0, copy.dst.0);
        let whole = copy.src.1 == 0 && copy.dst.1 == 0;
        let same_size =
            draft.made_bytes(dst).is_some() && draft.made_bytes(src) == draft.made_bytes(dst);
        let uses = |v: usize, range: std::ops::Range<usize>| {
            range
                .into_iter()
                .any(|i| launch_values(&draft.commands[i]).contains(&v))
        };
        let forwardable = whole
            && same_size
            && draft.is_intermediate(src)
            && !uses(src, at + 1..draft.commands.len())
            && !uses(dst, 0..at);
        if !forwardable {
            at += 1;
            continue;
        }
        for command in &mut draft.commands[..at] {
            rename(command, src, dst);
        }
        draft.commands.remove(at);
        removed += 1;
    }
    removed
}

/// Makes `command` use value `to` wherever it used `from`.
fn rename(command: &mut Command, from: usize, to: usize) {
    let swap = |v: &mut usize| {
        if *v == from {
            *v = to;
        }
    };
    match command {
        Command::Launch(l) => {
            l.bindings.iter_mut().for_each(|(_, v)| swap(v));
            if let Some(Fusion::Elementwise(f)) = &mut l.fusion {
                f.operands.iter_mut().for_each(|(v, _)| swap(v));
                swap(&mut f.output);
            }
        }
        Command::Upload(upload) => swap(&mut upload.target),
        Command::Copy(copy) => {
            swap(&mut copy.src.0);
            swap(&mut copy.dst.0);
        }
        Command::Hook(_) => {}
    }
}

/// Fuses the draft's elementwise runs in place. Returns how many launches it removed.
pub(crate) fn fuse(draft: &mut Draft, device: &Device) -> usize {
    // The most storage buffers a kernel may bind, with room to spare.
    let max_buffers = (device.inner.limits.max_storage_buffers_per_shader_stage as usize).min(8);
    let mut users: HashMap<usize, Vec<usize>> = HashMap::new();
    for (at, command) in draft.commands.iter().enumerate() {
        for v in launch_values(command) {
            users.entry(v).or_default().push(at);
        }
    }
    let mut fused: HashMap<usize, Command> = HashMap::new(); // at the last member's index
    let mut removed: HashSet<usize> = HashSet::new();
    for group in elementwise_runs(draft, &users, max_buffers) {
        if let Some((at, members, launch)) = epilogue(&group, draft, &users, max_buffers, device) {
            let last = *members.last().expect("one or more");
            removed.insert(at);
            removed.extend(members.iter().copied().filter(|&m| m != last));
            fused.insert(last, Command::Launch(launch));
            continue;
        }
        let Some((group, outputs)) = fit(group, draft, &users, max_buffers, None, 2) else {
            continue;
        };
        let launches: Vec<&Elementwise<usize>> =
            group.members.iter().map(|&u| member(draft, u)).collect();
        let Some(launch) = fused_launch(&launches, &outputs, &group.shape, device) else {
            continue;
        };
        let last = *group.members.last().expect("two or more");
        removed.extend(group.members.iter().copied().filter(|&at| at != last));
        fused.insert(last, Command::Launch(launch));
    }
    let before = draft.commands.len();
    let commands = std::mem::take(&mut draft.commands);
    for (at, command) in commands.into_iter().enumerate() {
        if removed.contains(&at) {
            continue;
        }
        draft.commands.push(fused.remove(&at).unwrap_or(command));
    }
    before - draft.commands.len()
}

/// The draft's runs of elementwise launches that may fuse, in order: a run grows while each
/// next launch joins it (see [`joins`]); anything else that touches its values ends it.
fn elementwise_runs(
    draft: &Draft,
    users: &HashMap<usize, Vec<usize>>,
    max_buffers: usize,
) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    let mut open: Option<Group> = None;
    for (at, command) in draft.commands.iter().enumerate() {
        let fusible = match command {
            Command::Launch(Launch {
                fusion: Some(Fusion::Elementwise(f)),
                ..
            }) => Some(f),
            _ => None,
        };
        if let (Some(f), Some(group)) = (fusible, open.as_mut()) {
            if joins(group, at, f, max_buffers, draft, users) {
                add(group, at, f);
                continue;
            }
        }
        if let Some(group) = &open {
            if fusible.is_some() || launch_values(command).iter().any(|&v| group.touches(v)) {
                groups.extend(open.take());
            }
        }
        if let Some(f) = fusible {
            let mut group = Group {
                members: Vec::new(),
                shape: f.shape.clone(),
                produced: Vec::new(),
                read: HashSet::new(),
            };
            add(&mut group, at, f);
            open = Some(group);
        }
    }
    groups.extend(open);
    groups
}

/// Whether the launch at `at` may join `group`: same shape, earlier results read in place,
/// and the buffers the fused kernel would bind within `max_buffers`.
/// The group trimmed from its end until its kernel binds at most `max_buffers` buffers, and
/// the values it must write; `None` when fewer than `min_members` are left, or when it would
/// write nothing. `in_register` is a value the kernel has in a register, not in memory (the
/// product an epilogue consumes).
fn fit(
    mut group: Group,
    draft: &Draft,
    users: &HashMap<usize, Vec<usize>>,
    max_buffers: usize,
    in_register: Option<usize>,
    min_members: usize,
) -> Option<(Group, Vec<usize>)> {
    while group.members.len() >= min_members.max(1) {
        let members: HashSet<usize> = group.members.iter().copied().collect();
        let outputs: Vec<usize> = group
            .produced
            .iter()
            .copied()
            .filter(|&v| {
                !draft.is_intermediate(v) || users[&v].iter().any(|at| !members.contains(at))
            })
            .collect();
        let produced: HashSet<usize> = group.produced.iter().copied().collect();
        let reads: HashSet<usize> = group
            .members
            .iter()
            .flat_map(|&at| match &draft.commands[at] {
                Command::Launch(Launch {
                    fusion: Some(Fusion::Elementwise(f)),
                    ..
                }) => f.operands.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
                _ => Vec::new(),
            })
            .filter(|v| !produced.contains(v) && Some(*v) != in_register)
            .collect();
        if reads.len() + outputs.len() <= max_buffers {
            return (!outputs.is_empty()).then_some((group, outputs));
        }
        group.members.pop();
        group.produced.pop();
    }
    None
}

fn joins(
    group: &Group,
    at: usize,
    f: &Elementwise<usize>,
    max_buffers: usize,
    draft: &Draft,
    users: &HashMap<usize, Vec<usize>>,
) -> bool {
    if f.shape != group.shape || group.members.len() >= MAX_MEMBERS {
        return false;
    }
    let mut new_reads = 0;
    for (v, layout) in &f.operands {
        if group.produced.contains(v) {
            if !reads_in_place(layout, &group.shape) {
                return false;
            }
        } else if !group.read.contains(v) {
            new_reads += 1;
        }
    }
    // Results that must be written: seen outside the plan, or used by an earlier launch that
    // is not a member, or by a later one that cannot join (another kind or shape). Later
    // elementwise launches of this shape are expected to join; `fit` trims the group where
    // one does not.
    let shape = &group.shape;
    let outside = |u: usize| -> bool {
        if u == at || group.members.contains(&u) {
            return false;
        }
        match &draft.commands[u] {
            Command::Launch(Launch {
                fusion: Some(Fusion::Elementwise(g)),
                ..
            }) => u < at || g.shape != *shape,
            _ => true,
        }
    };
    let written = group
        .produced
        .iter()
        .chain(std::iter::once(&f.output))
        .filter(|&&v| !draft.is_intermediate(v) || users[&v].iter().any(|&u| outside(u)))
        .count();
    group.read.len() + new_reads + written <= max_buffers
}

fn add(group: &mut Group, at: usize, f: &Elementwise<usize>) {
    group.members.push(at);
    for (v, _) in &f.operands {
        if !group.produced.contains(v) {
            group.read.insert(*v);
        }
    }
    group.produced.push(f.output);
}

/// How a fused kernel reads one operand from memory.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Access {
    /// Element `i` at `offset + i`.
    Dense { offset: usize },
    /// Element `i` at `offset + i % period`: a dense run repeated along leading dims (a bias).
    Periodic { offset: usize, period: usize },
    /// Through strides over the output's shape.
    Strided(Layout),
}

fn access_of(layout: &Layout) -> Access {
    let shape = &layout.shape;
    let mut period = 1;
    let mut d = shape.len();
    while d > 0 && (shape[d - 1] == 1 || layout.strides[d - 1] == period) {
        period *= shape[d - 1];
        d -= 1;
    }
    let numel: usize = shape.iter().product();
    let leading_repeat = (0..d).all(|i| shape[i] == 1 || layout.strides[i] == 0);
    match (leading_repeat, period == numel) {
        (true, true) => Access::Dense {
            offset: layout.offset,
        },
        (true, false) => Access::Periodic {
            offset: layout.offset,
            period: period.max(1),
        },
        (false, _) => Access::Strided(layout.clone()),
    }
}

fn float(v: f32) -> String {
    format!("bitcast<f32>({}u)", v.to_bits())
}

/// WGSL for the element index of a strided operand at element `i` of the output.
fn strided_index(layout: &Layout) -> String {
    let mut code = format!("{}u", layout.offset);
    let mut rem = "i".to_string();
    for d in (0..layout.shape.len()).rev() {
        let (n, s) = (layout.shape[d], layout.strides[d]);
        if n > 1 && s != 0 {
            let _ = write!(code, " + (({rem}) % {n}u) * {s}u");
        }
        rem = format!("({rem}) / {n}u");
    }
    code
}

/// The generated kernel for `launches` (in order), writing `outputs`, or `None` when naga
/// rejects it (the members then run unfused).
fn fused_launch(
    launches: &[&Elementwise<usize>],
    outputs: &[usize],
    shape: &[usize],
    device: &Device,
) -> Option<Launch> {
    let (source, bindings) = fused_source(launches, outputs, shape)?;
    if let Err(e) = validate(&source) {
        log::debug!("capture: a fused kernel failed validation, left unfused: {e}");
        return None;
    }
    let n: usize = shape.iter().product();
    let pipeline = generated_pipeline(device, "fused", "main", &source);
    let names: Vec<&str> = launches.iter().map(|f| f.expr.as_str()).collect();
    log::trace!(
        "capture: fused {} launches: {}",
        names.len(),
        names.join("; ")
    );
    Some(Launch {
        op: "fused elementwise",
        fusion: None,
        pipeline,
        bindings,
        params: bytemuck::bytes_of(&(n as u32)).to_vec(),
        dynamic_params: None,
        workgroups: groups(n, CONTIGUOUS_PER_GROUP),
        encoded: None,
    })
}

/// The element function of a fused kernel: the members' functions, `struct Outs` and
/// `fn element(m, l0, l1, ..) -> Outs`, which computes the outputs' values at one element from
/// the loaded operands (and `m`, the value an epilogue has in a register).
struct ElementFn {
    /// The values read from memory, one binding each.
    inputs: Vec<usize>,
    /// One load per (value, access): `element`'s parameters `l0`, `l1`, ...
    loads: Vec<(usize, Access)>,
    code: String,
}

impl ElementFn {
    /// Whether every load can read a whole aligned vec4 where the element index is a multiple
    /// of 4.
    fn loads_vec4(&self) -> bool {
        self.loads.iter().all(|(_, a)| match a {
            Access::Dense { offset } => offset.is_multiple_of(4),
            Access::Periodic { offset, period } => {
                offset.is_multiple_of(4) && period.is_multiple_of(4)
            }
            Access::Strided(_) => false,
        })
    }

    /// `let a{k} = ..;` for each load: of vec4 `i` where `vec4`, else of element `i`.
    fn load_lines(&self, vec4: bool, indent: &str) -> String {
        let mut src = String::new();
        for (k, (v, access)) in self.loads.iter().enumerate() {
            let slot = self.inputs.iter().position(|x| x == v).expect("an input");
            if vec4 {
                let at = match access {
                    Access::Dense { offset } => format!("{}u + i", offset / 4),
                    Access::Periodic { offset, period } => {
                        format!("{}u + i % {}u", offset / 4, period / 4)
                    }
                    Access::Strided(_) => unreachable!("vec4 needs no strides"),
                };
                let _ = writeln!(src, "{indent}let a{k} = in{slot}[{at}];");
            } else {
                let at = match access {
                    Access::Dense { offset } => format!("{offset}u + i"),
                    Access::Periodic { offset, period } => format!("{offset}u + i % {period}u"),
                    Access::Strided(layout) => strided_index(layout),
                };
                let _ = writeln!(src, "{indent}let e{k} = {at};");
                let _ = writeln!(src, "{indent}let a{k} = in{slot}[e{k} / 4u][e{k} % 4u];");
            }
        }
        src
    }

    /// The arguments of `element` for component `c` of the loads (`""` for scalar loads),
    /// after `first` (the register value, if any).
    fn args(&self, first: Option<String>, c: &str) -> String {
        let loaded = (0..self.loads.len()).map(|k| format!("a{k}{c}"));
        first
            .into_iter()
            .chain(loaded)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The element function for `launches` (in order) writing `outputs`, where `in_register`
/// is the value `element` takes as `m` instead of loading it.
fn element_fn(
    launches: &[&Elementwise<usize>],
    outputs: &[usize],
    in_register: Option<usize>,
) -> ElementFn {
    let produced: Vec<usize> = launches.iter().map(|f| f.output).collect();
    let mut inputs: Vec<usize> = Vec::new();
    let mut loads: Vec<(usize, Access)> = Vec::new();
    for f in launches {
        for (v, layout) in &f.operands {
            if produced.contains(v) || Some(*v) == in_register {
                continue;
            }
            if !inputs.contains(v) {
                inputs.push(*v);
            }
            let access = access_of(layout);
            if !loads.contains(&(*v, access.clone())) {
                loads.push((*v, access));
            }
        }
    }
    let mut src = String::new();
    for (k, f) in launches.iter().enumerate() {
        let _ = writeln!(
            src,
            "fn f{k}({}) -> f32 {{\n    return {};\n}}",
            f.params, f.expr
        );
    }
    let outs_fields: Vec<String> = (0..outputs.len()).map(|k| format!("o{k}: f32")).collect();
    let _ = writeln!(src, "struct Outs {{ {} }}", outs_fields.join(", "));
    let params: Vec<String> = in_register
        .map(|_| "m: f32".to_string())
        .into_iter()
        .chain((0..loads.len()).map(|k| format!("l{k}: f32")))
        .collect();
    let _ = writeln!(src, "fn element({}) -> Outs {{", params.join(", "));
    let mut value_name: HashMap<usize, String> = HashMap::new();
    if let Some(v) = in_register {
        value_name.insert(v, "m".into());
    }
    for (k, f) in launches.iter().enumerate() {
        let mut args: Vec<String> = Vec::new();
        for (v, layout) in &f.operands {
            if let Some(name) = value_name.get(v) {
                args.push(name.clone());
            } else {
                let access = access_of(layout);
                let l = loads
                    .iter()
                    .position(|(lv, la)| lv == v && *la == access)
                    .expect("gathered above");
                args.push(format!("l{l}"));
            }
        }
        args.extend(f.scalars.iter().map(|&s| float(s)));
        let _ = writeln!(src, "    let v{k} = f{k}({});", args.join(", "));
        value_name.insert(f.output, format!("v{k}"));
    }
    let out_values: Vec<String> = outputs.iter().map(|v| value_name[v].clone()).collect();
    let _ = writeln!(src, "    return Outs({});\n}}", out_values.join(", "));
    ElementFn {
        inputs,
        loads,
        code: src,
    }
}

/// The WGSL module of the kernel that runs `launches` (in order) and writes `outputs`, and
/// the value each of its bindings takes; `None` when it would write nothing.
fn fused_source(
    launches: &[&Elementwise<usize>],
    outputs: &[usize],
    shape: &[usize],
) -> Option<(String, Vec<(u32, usize)>)> {
    if outputs.is_empty() {
        return None;
    }
    let n: usize = shape.iter().product();
    let element = element_fn(launches, outputs, None);
    let vec4 = n.is_multiple_of(4) && element.loads_vec4();

    let mut src = String::new();
    let mut bindings: Vec<(u32, usize)> = Vec::new();
    for (k, v) in element.inputs.iter().enumerate() {
        let binding = 1 + k as u32;
        let _ = writeln!(
            src,
            "@group(0) @binding({binding}) var<storage, read> in{k}: array<vec4<f32>>;"
        );
        bindings.push((binding, *v));
    }
    for (k, v) in outputs.iter().enumerate() {
        let binding = 1 + (element.inputs.len() + k) as u32;
        let _ = writeln!(
            src,
            "@group(0) @binding({binding}) var<storage, read_write> out{k}: array<vec4<f32>>;"
        );
        bindings.push((binding, *v));
    }
    src.push_str(&element.code);

    // The entry point: a section of shaders/fused.wgsl, filled in.
    let indent = "        ";
    let (template, args) = if vec4 {
        let args: Vec<(String, String)> = (["X", "Y", "Z", "W"].iter())
            .map(|c| {
                (
                    format!("ARGS_{c}"),
                    element.args(None, &format!(".{}", c.to_lowercase())),
                )
            })
            .collect();
        (entry_template("VEC4 ENTRY"), args)
    } else {
        (
            entry_template("ELEMENT ENTRY"),
            vec![("ARGS".to_string(), element.args(None, ""))],
        )
    };
    let store = |k: usize| match vec4 {
        true => format!("{indent}out{k}[i] = vec4<f32>(rx.o{k}, ry.o{k}, rz.o{k}, rw.o{k});\n"),
        false => format!("{indent}out{k}[i / 4u][i % 4u] = r.o{k};\n"),
    };
    let stores: String = (0..outputs.len()).map(store).collect();
    let mut entry = template
        .replace(
            &format!("{indent}LOADS\n"),
            &element.load_lines(vec4, indent),
        )
        .replace(&format!("{indent}STORES\n"), &stores);
    for (placeholder, value) in args {
        entry = entry.replace(&placeholder, &value);
    }
    src.push_str(&entry);
    Some((format!("{COMMON_WGSL}\n{src}"), bindings))
}

/// The entry points of generated kernels, as templates (`shaders/fused.wgsl`).
const FUSED_WGSL: &str = include_str!("../../shaders/fused.wgsl");

/// The section `name` of [`FUSED_WGSL`] (between its `// {name} BEGIN` and `END` lines).
fn entry_template(name: &str) -> String {
    let begin = format!("// {name} BEGIN\n");
    let start = FUSED_WGSL.find(&begin).expect("a section of fused.wgsl") + begin.len();
    let end = FUSED_WGSL[start..]
        .find(&format!("// {name} END"))
        .expect("a closed section");
    FUSED_WGSL[start..start + end].to_string()
}

const EPILOGUE_BEGIN: &str = "// EPILOGUE SECTION BEGIN";
const EPILOGUE_END: &str = "// EPILOGUE SECTION END";

/// The module `source` (of a launch with epilogue `site`) with stores that run `launches`
/// (in order) on its output `m` and write `outputs` (the first at the launch's own output
/// binding), and the bindings it adds, numbered past every binding the module declares;
/// `None` when it would write nothing or the source has no epilogue section.
fn epilogue_source(
    source: &str,
    site: &EpilogueSite<usize>,
    launches: &[&Elementwise<usize>],
    outputs: &[usize],
    transposed: Option<(usize, usize)>,
) -> Option<(String, Vec<(u32, usize)>)> {
    let begin = source.find(EPILOGUE_BEGIN)?;
    let end = source.find(EPILOGUE_END)? + EPILOGUE_END.len();
    if outputs.is_empty() {
        return None;
    }
    // Past every binding the module declares (other entry points' too).
    let first_binding = declared_bindings(source).map(|(b, _)| b).max()? + 1;
    let element = element_fn(launches, outputs, Some(site.output));
    let mut src = String::new();
    let mut bindings: Vec<(u32, usize)> = Vec::new();
    let mut binding = first_binding;
    for (k, v) in outputs.iter().enumerate().skip(1) {
        let _ = writeln!(
            src,
            "@group(0) @binding({binding}) var<storage, read_write> out{k}: array<vec4<f32>>;"
        );
        bindings.push((binding, *v));
        binding += 1;
    }
    for (k, v) in element.inputs.iter().enumerate() {
        let _ = writeln!(
            src,
            "@group(0) @binding({binding}) var<storage, read> in{k}: array<vec4<f32>>;"
        );
        bindings.push((binding, *v));
        binding += 1;
    }
    src.push_str(&element.code);
    src.push_str(&epilogue_store1(&element, outputs.len(), site, transposed));
    src.push_str(&epilogue_store4(&element, outputs.len(), site, transposed));
    let module = format!(
        "{}{EPILOGUE_BEGIN}\n{src}{}",
        &source[..begin],
        &source[end..]
    );
    Some((module, bindings))
}

/// The name of output `k` of an epilogue: the producer's own `out`, then `out1`, ...
fn out_name(k: usize) -> String {
    match k {
        0 => "out".to_string(),
        _ => format!("out{k}"),
    }
}

/// An epilogue's `store1`: the launch's element `o` is the group's element `i` (the same
/// unless the group reads the launch's `[n, m]` output as its transpose); the group's
/// element function runs on the product `v` there and each of `outputs` outputs is stored.
fn epilogue_store1(
    element: &ElementFn,
    outputs: usize,
    site: &EpilogueSite<usize>,
    transposed: Option<(usize, usize)>,
) -> String {
    let mut src = String::from("fn store1(o: u32, v: f32) {\n");
    match transposed {
        Some((m, n)) => {
            let _ = writeln!(src, "    let i = (o % {m}u) * {n}u + o / {m}u;");
        }
        None => src.push_str("    let i = o;\n"),
    }
    src.push_str(&element.load_lines(false, "    "));
    let _ = writeln!(
        src,
        "    let r = element({});",
        element.args(Some("v".into()), "")
    );
    for k in 0..outputs {
        if k == 0 && !site.vec4_output {
            src.push_str("    out[i] = r.o0;\n");
        } else {
            let _ = writeln!(src, "    {}[i / 4u][i % 4u] = r.o{k};", out_name(k));
        }
    }
    src.push_str("}\n");
    src
}

/// An epilogue's `store4`: four elements from `o`, a multiple of 4, as vec4s where the group
/// reads them so, else through `store1`; none for a module that binds its output as f32s
/// (it stores one element at a time).
fn epilogue_store4(
    element: &ElementFn,
    outputs: usize,
    site: &EpilogueSite<usize>,
    transposed: Option<(usize, usize)>,
) -> String {
    if !site.vec4_output {
        return String::new();
    }
    if !element.loads_vec4() || transposed.is_some() {
        return "fn store4(o: u32, v: vec4<f32>) {\n    store1(o, v.x);\n    store1(o + 1u, v.y);\n    \
                store1(o + 2u, v.z);\n    store1(o + 3u, v.w);\n}\n"
            .to_string();
    }
    let mut src = String::from("fn store4(o: u32, v: vec4<f32>) {\n    let i = o / 4u;\n");
    src.push_str(&element.load_lines(true, "    "));
    for c in ["x", "y", "z", "w"] {
        let args = element.args(Some(format!("v.{c}")), &format!(".{c}"));
        let _ = writeln!(src, "    let r{c} = element({args});");
    }
    for k in 0..outputs {
        let _ = writeln!(
            src,
            "    {}[i] = vec4<f32>(rx.o{k}, ry.o{k}, rz.o{k}, rw.o{k});",
            out_name(k)
        );
    }
    src.push_str("}\n");
    src
}

/// The elementwise description of member `at`.
fn member(draft: &Draft, at: usize) -> &Elementwise<usize> {
    match &draft.commands[at] {
        Command::Launch(Launch {
            fusion: Some(Fusion::Elementwise(f)),
            ..
        }) => f,
        _ => unreachable!("members are fusible launches"),
    }
}

/// The launch with an epilogue site that makes a value the group's first member reads: its
/// index, the launch and the site.
fn producer_of<'a>(
    group: &Group,
    draft: &'a Draft,
) -> Option<(usize, &'a Launch, &'a EpilogueSite<usize>)> {
    let first = group.members[0];
    member(draft, first).operands.iter().find_map(|(v, _)| {
        (0..first).rev().find_map(|u| match &draft.commands[u] {
            Command::Launch(l) => match &l.fusion {
                Some(Fusion::Epilogue(site)) if site.output == *v => Some((u, l, site)),
                _ => None,
            },
            _ => None,
        })
    })
}

/// How the group's members read the product `m`: each at its own element (`Some(None)`), or
/// all as the transpose of a 2-D `[rows, cols]` product (`Some(Some((rows, cols)))`: a narrow
/// product is computed transposed, a classifier head); `None` when neither, so no fusion.
fn how_members_read(group: &Group, draft: &Draft, m: usize) -> Option<Option<(usize, usize)>> {
    let reads_of_m: Vec<&Layout> = group
        .members
        .iter()
        .flat_map(|&u| member(draft, u).operands.iter())
        .filter(|(v, _)| *v == m)
        .map(|(_, layout)| layout)
        .collect();
    let transposed = match group.shape[..] {
        [rows, cols] => {
            let layout = Layout {
                shape: vec![rows, cols],
                strides: vec![1, rows],
                offset: 0,
            };
            (!reads_of_m.is_empty() && reads_of_m.iter().all(|l| **l == layout))
                .then_some((rows, cols))
        }
        _ => None,
    };
    let in_place = reads_of_m.iter().all(|l| reads_in_place(l, &group.shape));
    (transposed.is_some() || in_place).then_some(transposed)
}

/// Fuses `group` into the launch that makes the value its first member reads, when that
/// launch has an epilogue site and only the group reads its output, in place: returns the
/// launch's index, the members fused, and the launch that replaces them all at the last
/// member's place.
fn epilogue(
    group: &Group,
    draft: &Draft,
    users: &HashMap<usize, Vec<usize>>,
    max_buffers: usize,
    device: &Device,
) -> Option<(usize, Vec<usize>, Launch)> {
    let (at, producer, site) = producer_of(group, draft)?;
    let m = site.output;
    let numel: usize = group.shape.iter().product();
    if numel != site.numel {
        return None;
    }
    let transposed = how_members_read(group, draft, m)?;
    // The producer's own operands stay bound (see `epilogue_launch`).
    let operands = producer.bindings.iter().filter(|&&(_, v)| v != m).count();
    // `m` itself is written too when the plan's output or a later launch reads it (one more
    // buffer); then no launch between the producer and the group's end may read it.
    let budget = max_buffers.checked_sub(operands)?;
    let read_elsewhere = |members: &[usize]| {
        !draft.is_intermediate(m) || users[&m].iter().any(|u| *u != at && !members.contains(u))
    };
    let reserve = usize::from(read_elsewhere(&group.members));
    let (group, mut outputs) = fit(
        group.clone(),
        draft,
        users,
        budget.checked_sub(reserve)?,
        Some(m),
        1,
    )?;
    let last = *group.members.last().expect("one or more");
    if read_elsewhere(&group.members) {
        let read_early = users[&m]
            .iter()
            .any(|&u| u != at && u < last && !group.members.contains(&u));
        // A transposed epilogue stores in the group's order, not in `m`'s.
        if reserve == 0 || read_early || transposed.is_some() {
            return None;
        }
        outputs.insert(0, m);
    }
    let members: HashSet<usize> = group.members.iter().copied().collect();
    // The producer moves to the last member's place: past launches that commute with it
    // only (none writes what it reads, nor touches what else it writes: LayerNorm's row
    // statistics).
    let moved_past = (at + 1..last)
        .filter(|u| !members.contains(u))
        .any(|u| !commute(&draft.commands[u], &draft.commands[at]));
    if moved_past {
        return None;
    }
    let launches: Vec<&Elementwise<usize>> =
        group.members.iter().map(|&u| member(draft, u)).collect();
    let fused = epilogue_launch(producer, site, &launches, &outputs, transposed, device)?;
    Some((at, group.members, fused))
}

/// The producer with `launches` run in its stores, writing `outputs` (the first at the
/// producer's output binding), as one generated launch; `None` when its module does not
/// validate (the group then stays unfused).
fn epilogue_launch(
    producer: &Launch,
    site: &EpilogueSite<usize>,
    launches: &[&Elementwise<usize>],
    outputs: &[usize],
    transposed: Option<(usize, usize)>,
    device: &Device,
) -> Option<Launch> {
    let m = site.output;
    let output_binding = producer
        .bindings
        .iter()
        .find(|&&(_, v)| v == m)
        .map(|&(b, _)| b)?;
    let (source, extra) = epilogue_source(
        &producer.pipeline.source,
        site,
        launches,
        outputs,
        transposed,
    )?;
    if let Err(e) = validate(&source) {
        log::debug!("capture: an epilogue failed validation, left unfused: {e}");
        return None;
    }
    let pipeline = generated_pipeline(device, "epilogue", site.entry, &source);
    // The producer's own operands stay bound; its output becomes the first written value.
    let mut bindings: Vec<(u32, usize)> = (producer.bindings.iter().copied())
        .filter(|&(_, v)| v != m)
        .collect();
    bindings.push((output_binding, outputs[0]));
    bindings.extend(extra);
    Some(Launch {
        op: producer.op,
        fusion: None,
        pipeline,
        bindings,
        params: producer.params.clone(),
        dynamic_params: producer.dynamic_params.clone(),
        workgroups: producer.workgroups,
        encoded: None,
    })
}

/// Whether `a` and `b` may run in either order: neither writes a value the other touches,
/// and no host hook passes a launch whose params are computed at replay (a replay runs hooks
/// and those params' closures in plan order: an optimizer's hook advances the step count its
/// updates' params read).
fn commute(a: &Command, b: &Command) -> bool {
    let hook_and_dynamic = |x: &Command, y: &Command| {
        matches!(x, Command::Hook(_))
            && matches!(y, Command::Launch(l) if l.dynamic_params.is_some())
    };
    !hook_and_dynamic(a, b)
        && !hook_and_dynamic(b, a)
        && writes_apart(
            &launch_values(a),
            |v| writes(a, v),
            &launch_values(b),
            |v| writes(b, v),
        )
}

/// As [`commute`], for two launches of a merged run (no hook between them).
fn launches_commute(a: &Launch, b: &Launch) -> bool {
    let values = |l: &Launch| -> Vec<usize> { l.bindings.iter().map(|&(_, v)| v).collect() };
    writes_apart(
        &values(a),
        |v| launch_writes(a, v),
        &values(b),
        |v| launch_writes(b, v),
    )
}

/// Whether neither of two commands (the values each touches, and which of them it writes)
/// writes a value the other touches.
fn writes_apart(
    a: &[usize],
    a_writes: impl Fn(usize) -> bool,
    b: &[usize],
    b_writes: impl Fn(usize) -> bool,
) -> bool {
    !a.iter().any(|&v| a_writes(v) && b.contains(&v))
        && !b.iter().any(|&v| b_writes(v) && a.contains(&v))
}

/// The most launches one merged launch takes.
const MAX_PARTS: usize = 8;

const MEMBER_BEGIN: &str = "// MEMBER SECTION BEGIN";
const MEMBER_END: &str = "// MEMBER SECTION END";

/// Merges runs of consecutive launches of one pipeline that run a part of their module's
/// MEMBER SECTION (an optimizer's update of each parameter, a backward pass's reductions)
/// into launches of one generated kernel each: a copy of the section per launch, with its own
/// names, bindings and param slots, each over workgroups of its own. A run is first ordered
/// by dependency (a two-pass reduction's second pass after every first pass of the run), and
/// as many independent launches go into one as the device's storage bindings and the 63
/// param slots allow. Returns how many launches it removed.
pub(crate) fn merge_parts(draft: &mut Draft, device: &Device) -> usize {
    let max_buffers = device.inner.limits.max_storage_buffers_per_shader_stage as usize;
    let before = draft.commands.len();
    let mut commands = Vec::with_capacity(before);
    let mut run: Vec<Launch> = Vec::new();
    for command in std::mem::take(&mut draft.commands) {
        match command {
            Command::Launch(l) if matches!(l.fusion, Some(Fusion::Merge(_))) => {
                if run
                    .first()
                    .is_some_and(|r| !Arc::ptr_eq(&r.pipeline, &l.pipeline))
                {
                    commands.extend(merged_run(std::mem::take(&mut run), max_buffers, device));
                }
                run.push(l);
            }
            other => {
                commands.extend(merged_run(std::mem::take(&mut run), max_buffers, device));
                commands.push(other);
            }
        }
    }
    commands.extend(merged_run(run, max_buffers, device));
    draft.commands = commands;
    before - draft.commands.len()
}

/// The launches of `run` (consecutive, one pipeline) by dependency level, each level's
/// launches merged as far as the budget allows.
fn merged_run(run: Vec<Launch>, max_buffers: usize, device: &Device) -> Vec<Command> {
    // A launch's level: one past the highest level of an earlier launch it does not commute
    // with. Launches of one level are independent of each other.
    let mut levels: Vec<usize> = Vec::with_capacity(run.len());
    for (j, launch) in run.iter().enumerate() {
        let level = (0..j)
            .filter(|&i| !launches_commute(&run[i], launch))
            .map(|i| levels[i] + 1)
            .max()
            .unwrap_or(0);
        levels.push(level);
    }
    let mut by_level: Vec<Vec<Launch>> = Vec::new();
    for (launch, level) in run.into_iter().zip(levels) {
        if by_level.len() <= level {
            by_level.resize_with(level + 1, Vec::new);
        }
        by_level[level].push(launch);
    }
    let mut out = Vec::new();
    for level in by_level {
        let mut chunk: Vec<Launch> = Vec::new();
        for launch in level {
            if !fits_chunk(&chunk, &launch, max_buffers) {
                out.extend(merged(std::mem::take(&mut chunk), device));
            }
            chunk.push(launch);
        }
        out.extend(merged(chunk, device));
    }
    out
}

fn merge_site(launch: &Launch) -> &MergeSite {
    match &launch.fusion {
        Some(Fusion::Merge(site)) => site,
        _ => unreachable!("runs hold mergeable launches"),
    }
}

/// Whether `next` may join `chunk` (independent launches of one pipeline; an empty chunk
/// takes anything): room for its buffers and params.
fn fits_chunk(chunk: &[Launch], next: &Launch, max_buffers: usize) -> bool {
    let buffers: usize =
        chunk.iter().map(|l| l.bindings.len()).sum::<usize>() + next.bindings.len();
    chunk.len() < MAX_PARTS
        && (chunk.len() + 1) * merge_site(next).param_slots <= MAX_SLOTS
        && buffers <= max_buffers
}

/// One launch for `run` (the launch itself when it holds one; `run` unmerged when the
/// generated kernel fails naga's validation).
fn merged(run: Vec<Launch>, device: &Device) -> Vec<Command> {
    let unmerged = |run: Vec<Launch>| run.into_iter().map(Command::Launch).collect();
    if run.len() < 2 {
        return unmerged(run);
    }
    let site = merge_site(&run[0]);
    let source = &run[0].pipeline.source;
    let (Some(begin), Some(end)) = (source.find(MEMBER_BEGIN), source.find(MEMBER_END)) else {
        return unmerged(run);
    };
    let section = &source[begin..end];
    let mut src = source[..begin].to_string();
    let mut bindings: Vec<(u32, usize)> = Vec::new();
    let mut starts: Vec<u32> = Vec::new();
    let mut workgroups = 0;
    let span = section_bindings(section);
    for (k, launch) in run.iter().enumerate() {
        let shift = k as u32 * span;
        src.push_str(&member_copy(section, k, shift, k * site.param_slots));
        bindings.extend(launch.bindings.iter().map(|&(b, v)| (b + shift, v)));
        starts.push(workgroups);
        workgroups += launch.workgroups;
    }
    let part = site.part;
    let mut parts = String::new();
    for k in 0..run.len() - 1 {
        let _ = writeln!(
            parts,
            "    if (w < {}u) {{\n        {part}_{k}(w - {}u, lid);\n        return;\n    }}",
            starts[k + 1],
            starts[k]
        );
    }
    let last = run.len() - 1;
    let _ = writeln!(parts, "    {part}_{last}(w - {}u, lid);", starts[last]);
    src.push_str(&entry_template("MERGED ENTRY").replace("    PARTS\n", &parts));
    if let Err(e) = validate(&src) {
        log::debug!("capture: a merged launch failed validation, left unmerged: {e}");
        return unmerged(run);
    }
    let (params, dynamic_params) = merged_params(&run, site.param_slots * 4);
    let pipeline = generated_pipeline(device, "merged", "main", &src);
    vec![Command::Launch(Launch {
        op: run[0].op,
        fusion: None,
        pipeline,
        bindings,
        params,
        dynamic_params,
        workgroups,
        encoded: None,
    })]
}

/// The params of a merged launch: each launch's in a block of `slot_bytes` of its own, and,
/// when any launch computes its params at replay, the function that packs them then.
fn merged_params(run: &[Launch], slot_bytes: usize) -> (Vec<u8>, Option<HostBytes>) {
    let pack = move |blocks: Vec<Vec<u8>>| -> Vec<u8> {
        let mut out = Vec::with_capacity(blocks.len() * slot_bytes);
        for mut block in blocks {
            block.resize(slot_bytes, 0);
            out.extend(block);
        }
        out
    };
    let params = pack(run.iter().map(|l| l.params.clone()).collect());
    let dynamic_params = run.iter().any(|l| l.dynamic_params.is_some()).then(|| {
        let parts: Vec<(Vec<u8>, Option<HostBytes>)> = run
            .iter()
            .map(|l| (l.params.clone(), l.dynamic_params.clone()))
            .collect();
        let dynamic: HostBytes = Arc::new(move || {
            pack(
                parts
                    .iter()
                    .map(|(fixed, f)| f.as_ref().map_or_else(|| fixed.clone(), |f| f()))
                    .collect(),
            )
        });
        dynamic
    });
    (params, dynamic_params)
}

/// How many binding numbers a member section spans (from its lowest to its highest).
fn section_bindings(section: &str) -> u32 {
    let numbers: Vec<u32> = declared_bindings(section).map(|(b, _)| b).collect();
    match (numbers.iter().min(), numbers.iter().max()) {
        (Some(lo), Some(hi)) => hi - lo + 1,
        _ => 0,
    }
}

/// Copy `k` of a member section: every name the section declares (its buffers and
/// functions) suffixed `_k`, its bindings moved up by `shift`, its params read from slot
/// `base` on.
fn member_copy(section: &str, k: usize, shift: u32, base: usize) -> String {
    let mut names: Vec<&str> = Vec::new();
    for line in section.lines() {
        let line = line.trim_start();
        let declared = if let Some(rest) = line.strip_prefix("fn ") {
            rest.split('(').next()
        } else if line.contains("var<") {
            line.split('>').nth(1).and_then(|r| r.split(':').next())
        } else {
            None
        };
        names.extend(declared.map(str::trim).filter(|n| !n.is_empty()));
    }
    let mut out = String::with_capacity(section.len() + 64);
    let mut rest = section;
    while let Some(at) = rest.find(|c: char| c.is_ascii_alphabetic() || c == '_' || c == '@') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        if let Some(tail) = rest.strip_prefix("@binding(") {
            let close = tail.find(')').expect("a closed binding attribute");
            let number: u32 = tail[..close].trim().parse().expect("a binding number");
            let _ = write!(out, "@binding({})", number + shift);
            rest = &tail[close + 1..];
            continue;
        }
        let len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '@'))
            .unwrap_or(rest.len());
        let word = &rest[..len];
        out.push_str(word);
        if names.contains(&word) {
            let _ = write!(out, "_{k}");
        } else if (word == "pu" || word == "pf") && rest[len..].starts_with('(') {
            let _ = write!(out, "({base}u + ");
            rest = &rest[len + 1..];
            continue;
        }
        rest = &rest[len..];
    }
    out.push_str(rest);
    out
}

/// The pipeline of a generated module, keyed by a hash of its source under
/// [`GENERATED`], so the cache lets it go with the last plan that holds it.
fn generated_pipeline(
    device: &Device,
    family: &str,
    entry: &'static str,
    source: &str,
) -> Arc<crate::device::CachedPipeline> {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    source.hash(&mut hasher);
    let module_key = format!("{GENERATED}{family}/{:016x}", hasher.finish());
    let key = format!("{module_key}:{entry}");
    device.inner.pipeline(&PipelineSource {
        key: &key,
        module_key: &module_key,
        entry,
        source: &|| source.to_string(),
    })
}

/// Parses and validates a generated module with naga, as wgpu would, before it is compiled.
pub(crate) fn validate(source: &str) -> Result<(), String> {
    let module = naga::front::wgsl::parse_str(source).map_err(|e| e.emit_to_string(source))?;
    naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .map(|_| ())
    .map_err(|e| e.emit_to_string(source))
}

#[cfg(test)]
mod tests {
    use super::{fused_source, validate};
    use crate::kernel::Elementwise;
    use crate::tensor::Layout;

    fn op(
        params: &'static str,
        expr: &str,
        scalars: &[f32],
        operands: &[(usize, Layout)],
        output: usize,
        shape: &[usize],
    ) -> Elementwise<usize> {
        Elementwise {
            params,
            expr: expr.into(),
            scalars: scalars.to_vec(),
            operands: operands.to_vec(),
            output,
            shape: shape.to_vec(),
        }
    }

    /// `relu(a * b + bias)` over [6, 8] with a bias row, as the vec4 path and, over [5, 7]
    /// with a transposed operand, as the strided path: both modules pass naga.
    #[test]
    fn generated_kernels_pass_naga() {
        for (shape, b_layout) in [
            (
                vec![6, 8],
                Layout {
                    shape: vec![6, 8],
                    strides: vec![0, 1],
                    offset: 0,
                },
            ),
            (
                vec![5, 7],
                Layout {
                    shape: vec![5, 7],
                    strides: vec![1, 5],
                    offset: 3,
                },
            ),
        ] {
            let dense = Layout::contiguous(&shape);
            let ops = [
                op(
                    "a: f32, b: f32, s: f32",
                    "a * b",
                    &[0.0],
                    &[(0, dense.clone()), (1, b_layout.clone())],
                    2,
                    &shape,
                ),
                op(
                    "a: f32, b: f32, s: f32",
                    "a + b",
                    &[0.0],
                    &[(2, dense.clone()), (0, dense.clone())],
                    3,
                    &shape,
                ),
                op(
                    "x: f32, s: f32, t: f32",
                    "select(max(x, 0.0), x, is_nan(x))",
                    &[0.0, 0.0],
                    &[(3, dense.clone())],
                    4,
                    &shape,
                ),
            ];
            let refs: Vec<&Elementwise<usize>> = ops.iter().collect();
            let (source, bindings) = fused_source(&refs, &[2, 4], &shape).unwrap();
            validate(&source).unwrap_or_else(|e| panic!("{e}\n{source}"));
            // Two inputs, two outputs (the product is kept, the sum stays in registers).
            assert_eq!(bindings, vec![(1, 0), (2, 1), (3, 2), (4, 4)]);
        }
    }

    /// A member section's copy renames what the section declares (not what it calls),
    /// moves its bindings, and reads its params from its own block.
    #[test]
    fn a_member_copy_has_its_own_names_bindings_and_params() {
        let section = "@group(0) @binding(1) var<storage, read> src: array<f32>;\n\
                       @group(0) @binding(2) var<storage, read_write> dst: array<f32>;\n\
                       fn part(w: u32, lid: u32) {\n\
                       \x20   dst[w] = combine(src[w], pf(SCALE)) + f32(pu(N));\n\
                       }\n";
        let copy = super::member_copy(section, 2, 4, 9);
        assert!(
            copy.contains("@binding(5) var<storage, read> src_2"),
            "{copy}"
        );
        assert!(
            copy.contains("@binding(6) var<storage, read_write> dst_2"),
            "{copy}"
        );
        assert!(copy.contains("fn part_2(w: u32, lid: u32)"), "{copy}");
        assert!(
            copy.contains("dst_2[w] = combine(src_2[w], pf(9u + SCALE)) + f32(pu(9u + N));"),
            "{copy}"
        );
        assert_eq!(super::section_bindings(section), 2);
    }

    #[test]
    fn naga_rejects_a_kernel_with_an_unknown_function() {
        let shape = [4];
        let dense = Layout::contiguous(&shape);
        let bad = op("x: f32", "no_such_fn(x)", &[], &[(0, dense)], 1, &shape);
        let (source, _) = fused_source(&[&bad], &[1], &shape).unwrap();
        assert!(validate(&source).unwrap_err().contains("no_such_fn"));
    }
}
