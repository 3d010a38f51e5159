//! The WGSL a captured step's passes generate: the fused elementwise kernel (bindings, the
//! element function, an entry point from `shaders/fused.wgsl`), the stores an epilogue puts
//! in a producer's EPILOGUE SECTION, the copies of a MEMBER SECTION a merged launch repeats,
//! and naga's validation of each. The passes (`passes/`) decide; this file only writes.

use std::collections::HashMap;
use std::fmt::Write;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::device::{declared_bindings, Device, PipelineSource, GENERATED};
use crate::kernel::{Elementwise, EpilogueSite, MergeSite, COMMON_WGSL};
use crate::tensor::Layout;

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
pub(crate) fn fused_source(
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
pub(crate) fn epilogue_source(
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
    src.push_str(&epilogue_store1(
        &element,
        outputs.len(),
        site.vec4_output,
        transposed,
    ));
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

/// An epilogue's `store1` (into a module binding its output as vec4s or as f32s): the
/// launch's element `o` is the group's element `i` (the same
/// unless the group reads the launch's `[n, m]` output as its transpose); the group's
/// element function runs on the product `v` there and each of `outputs` outputs is stored.
fn epilogue_store1(
    element: &ElementFn,
    outputs: usize,
    vec4_output: bool,
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
        if k == 0 && !vec4_output {
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

const MEMBER_BEGIN: &str = "// MEMBER SECTION BEGIN";

const MEMBER_END: &str = "// MEMBER SECTION END";

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
pub(crate) fn generated_pipeline(
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
        // Generated kernels read 16-bit operands, where they have any, as packed words.
        f16_bindings: 0,
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

/// A merged launch's module, the bindings of its members (shifted) and their workgroups in all.
pub(crate) struct MergedModule {
    pub source: String,
    pub bindings: Vec<(u32, usize)>,
    pub workgroups: u32,
}

/// The module of a merged launch: `source`'s MEMBER SECTION once per member (each with its
/// own names, bindings shifted past the previous member's, and param slots), then a `main`
/// sending each workgroup to its member's part; also the merged bindings and workgroup count.
/// `None` when `source` has no MEMBER SECTION.
pub(crate) fn merged_source(
    source: &str,
    site: &MergeSite,
    members: &[(&[(u32, usize)], u32)],
) -> Option<MergedModule> {
    let (begin, end) = (source.find(MEMBER_BEGIN)?, source.find(MEMBER_END)?);
    let section = &source[begin..end];
    let mut src = source[..begin].to_string();
    let mut bindings: Vec<(u32, usize)> = Vec::new();
    let mut starts: Vec<u32> = Vec::new();
    let mut workgroups = 0;
    let span = section_bindings(section);
    for (k, (member_bindings, member_workgroups)) in members.iter().enumerate() {
        let shift = k as u32 * span;
        src.push_str(&member_copy(section, k, shift, k * site.param_slots));
        bindings.extend(member_bindings.iter().map(|&(b, v)| (b + shift, v)));
        starts.push(workgroups);
        workgroups += member_workgroups;
    }
    let part = site.part;
    let mut parts = String::new();
    for k in 0..members.len() - 1 {
        let _ = writeln!(
            parts,
            "    if (w < {}u) {{\n        {part}_{k}(w - {}u, lid);\n        return;\n    }}",
            starts[k + 1],
            starts[k]
        );
    }
    let last = members.len() - 1;
    let _ = writeln!(parts, "    {part}_{last}(w - {}u, lid);", starts[last]);
    src.push_str(&entry_template("MERGED ENTRY").replace("    PARTS\n", &parts));
    Some(MergedModule {
        source: src,
        bindings,
        workgroups,
    })
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
