//! `PipelineCache`: each (kernel, specialisation) is compiled once and kept for the life of
//! the device; the modules a captured step generates (keys under [`GENERATED`]) are dropped
//! once no plan holds their pipelines.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use super::{F16Reads, PipelineSource};

/// A compiled compute pipeline and the layout of its one bind group.
pub(crate) struct CachedPipeline {
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
    /// The bindings its module declares `read_write`: the buffers a launch may write (what
    /// the capture fuser needs to know before it moves a launch).
    pub writable: Vec<u32>,
    /// Its module's source (the capture fuser builds merged kernels from it).
    pub source: Arc<str>,
    /// True until its first dispatch is recorded (see `DeviceInner::dispatch`).
    pub unused: AtomicBool,
}

/// Each `@binding(N)` that `source` declares, with the line that declares it.
pub(crate) fn declared_bindings(source: &str) -> impl Iterator<Item = (u32, &str)> {
    source.lines().filter_map(|line| {
        let (_, rest) = line.split_once("@binding(")?;
        Some((rest.split_once(')')?.0.trim().parse().ok()?, line))
    })
}

/// The bindings of group 0 that `source` declares as storage the module may write (`var<storage,
/// read_write>`), read from the module naga parses (every binding when it does not parse:
/// wgpu then reports the module's error, and nothing may be assumed unwritten).
fn writable_bindings(source: &str) -> Vec<u32> {
    let Ok(module) = naga::front::wgsl::parse_str(source) else {
        return declared_bindings(source)
            .map(|(binding, _)| binding)
            .collect();
    };
    let mut writable: Vec<u32> = (module.global_variables.iter())
        .filter_map(|(_, var)| {
            let binding = var.binding.as_ref().filter(|b| b.group == 0)?;
            match var.space {
                naga::AddressSpace::Storage { access } => access
                    .contains(naga::StorageAccess::STORE)
                    .then_some(binding.binding),
                _ => None,
            }
        })
        .collect();
    writable.sort_unstable();
    writable
}

/// What the device compiles for `source`: the source itself with `F16Reads::Integer`; with
/// `Hardware`, `shaders/f16_hardware_reads.wgsl` in place of `sixteen_bit.wgsl`'s F16 READS
/// section; with `Native`, that and each F16 operand of `f16_bindings` bound as WGSL `f16`
/// (see [`with_native_f16_operand`]). A module keeps the source it was given
/// (`CachedPipeline::source`): that is what the capture fuser builds from.
pub(crate) fn compiled_source(source: &str, reads: F16Reads, f16_bindings: u64) -> Cow<'_, str> {
    const BEGIN: &str = "// F16 READS BEGIN";
    const END: &str = "// F16 READS END";
    const HARDWARE: &str = include_str!("../../shaders/f16_hardware_reads.wgsl");
    if reads == F16Reads::Integer {
        return Cow::Borrowed(source);
    }
    let mut compiled = Cow::Borrowed(source);
    if let Some((start, end)) = section(source, BEGIN, END) {
        compiled = Cow::Owned(format!("{}{HARDWARE}{}", &source[..start], &source[end..]));
    }
    if reads == F16Reads::Native {
        let operands: Vec<String> = declared_bindings(&compiled)
            .filter(|(binding, _)| *binding < 64 && f16_bindings >> binding & 1 == 1)
            .filter_map(|(_, line)| packed_operand(line).map(str::to_string))
            .collect();
        for name in operands {
            if let Some(native) = with_native_f16_operand(&compiled, &name) {
                compiled = Cow::Owned(native);
            }
        }
    }
    compiled
}

/// The byte range from `begin` to the end of `end` in `source`, markers included.
fn section(source: &str, begin: &str, end: &str) -> Option<(usize, usize)> {
    let start = source.find(begin)?;
    Some((start, source[start..].find(end)? + start + end.len()))
}

/// The name a declaration line gives a read-only operand bound as packed words
/// (`var<storage, read> NAME: array<vec4<u32>>;`), the form the elementwise families and
/// matmul give every operand.
fn packed_operand(line: &str) -> Option<&str> {
    let (_, rest) = line.split_once("var<storage, read> ")?;
    let (name, ty) = rest.split_once(':')?;
    (ty.trim() == "array<vec4<u32>>;").then_some(name.trim())
}

/// `source` with operand `name` bound as `array<vec4<f16>>` and its reads (`name_at`,
/// `name_quad`, between `// F16 OPERAND name BEGIN` and `// F16 OPERAND name END`) those of
/// `shaders/f16_native_reads.wgsl`, under `enable f16;`; `None` where the module has no such
/// section for `name` (it reads the operand some other way, and keeps the packed words).
fn with_native_f16_operand(source: &str, name: &str) -> Option<String> {
    const NATIVE: &str = include_str!("../../shaders/f16_native_reads.wgsl");
    let begin = format!("// F16 OPERAND {name} BEGIN");
    let end = format!("// F16 OPERAND {name} END");
    let (start, stop) = section(source, &begin, &end)?;
    let packed = format!("var<storage, read> {name}: array<vec4<u32>>;");
    let native = format!("var<storage, read> {name}: array<vec4<f16>>;");
    let reads = NATIVE.replace("OPERAND", name);
    let body =
        format!("{}{reads}{}", &source[..start], &source[stop..]).replacen(&packed, &native, 1);
    Some(match body.starts_with("enable f16;") {
        true => body,
        false => format!("enable f16;\n{body}"),
    })
}

/// The runtime checks wgpu compiles into every kernel: all of them but loop bounding, a
/// counter that naga adds to each loop so that a shader cannot hang the GPU. wgrad's loops all
/// end (see `get_or_compile`), and the counter hides their trip counts from the driver's
/// compiler: with it, the attention kernels took 18 % longer to compile on lavapipe 25 (a
/// model's first step compiles its kernels there), and a transformer block's kernels 6 %.
const KERNEL_CHECKS: wgpu::ShaderRuntimeChecks = wgpu::ShaderRuntimeChecks {
    force_loop_bounding: false,
    ..wgpu::ShaderRuntimeChecks::checked()
};

/// The module-key prefix of the kernels the capture fuser generates: one per plan's shapes,
/// so they are released with the plans that use them, not kept for the device's life.
pub(crate) const GENERATED: &str = "generated/";

/// Compiled pipelines by key (`"family/specialisation:entry"`), and the shader modules they
/// come from by module key (`"family/specialisation"`): the entry points of one module share
/// one parse and validation.
#[derive(Default)]
pub(crate) struct PipelineCache {
    pipelines: HashMap<String, Arc<CachedPipeline>>,
    modules: HashMap<String, (wgpu::ShaderModule, Vec<u32>, Arc<str>)>,
}

impl PipelineCache {
    /// The cached pipeline for `kernel.key`, compiling its entry point on first use (and the
    /// module, the first time any entry of `kernel.module_key` is used), its F16 operands
    /// read through `f16_reads`. Compiles under `context` (the device's context lock: see
    /// `DeviceInner::in_context`).
    pub fn get_or_compile(
        &mut self,
        device: &wgpu::Device,
        context: &Mutex<()>,
        f16_reads: F16Reads,
        kernel: &PipelineSource,
    ) -> Arc<CachedPipeline> {
        let PipelineSource {
            key,
            module_key,
            entry,
            source,
            f16_bindings,
        } = *kernel;
        if let Some(cached) = self.pipelines.get(key) {
            return cached.clone();
        }
        let _context = super::lock(context);
        let (module, writable, module_source) = self
            .modules
            .entry(module_key.to_string())
            .or_insert_with(|| {
                let source: Arc<str> = source().into();
                let writable = writable_bindings(&source);
                let descriptor = wgpu::ShaderModuleDescriptor {
                    label: Some(module_key),
                    source: wgpu::ShaderSource::Wgsl(compiled_source(
                        &source,
                        f16_reads,
                        f16_bindings,
                    )),
                };
                // SAFETY: without loop bounding no kernel may loop forever, and none does:
                // every loop in shaders/ and in the capture fuser's generated kernels runs to
                // a count from its params or a constant, except index_select_scatter's
                // compare-and-swap, which ends when its exchange succeeds. Bounds checks stay.
                let module =
                    unsafe { device.create_shader_module_trusted(descriptor, KERNEL_CHECKS) };
                (module, writable, source)
            });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(key),
            layout: None,
            module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        });
        let layout = pipeline.get_bind_group_layout(0);
        let cached = Arc::new(CachedPipeline {
            pipeline,
            layout,
            writable: writable.clone(),
            source: module_source.clone(),
            unused: AtomicBool::new(true),
        });
        self.pipelines.insert(key.to_string(), cached.clone());
        cached
    }

    /// Forgets every pipeline and module (they compile again at their next use); pipelines
    /// a captured plan holds live on with it.
    pub fn clear(&mut self) {
        self.pipelines.clear();
        self.modules.clear();
    }

    /// How many pipelines the cache holds.
    pub fn len(&self) -> usize {
        self.pipelines.len()
    }

    /// Drops the generated pipelines nothing else holds (their plans are gone), and the
    /// generated modules no pipeline left comes from.
    pub fn release_unheld_generated(&mut self) {
        self.pipelines
            .retain(|key, p| !key.starts_with(GENERATED) || Arc::strong_count(p) > 1);
        let pipelines = &self.pipelines;
        self.modules.retain(|module, _| {
            !module.starts_with(GENERATED)
                || pipelines.keys().any(|key| {
                    key.strip_prefix(module.as_str())
                        .is_some_and(|r| r.starts_with(':'))
                })
        });
    }
}

#[cfg(test)]
mod tests {
    use super::F16Reads;

    #[test]
    fn hardware_f16_reads_replace_the_integer_section_of_a_module() {
        let prelude = include_str!("../../shaders/sixteen_bit.wgsl");
        let source = format!("{prelude}\nfn main() {{}}");
        let hardware = super::compiled_source(&source, F16Reads::Hardware, 0);
        assert!(hardware.contains("unpack2x16float(h).x"));
        assert!(!hardware.contains("// F16 READS BEGIN\n"));
        assert_eq!(hardware.matches("fn f16_read(").count(), 1);
        let integer = super::compiled_source(&source, F16Reads::Integer, u64::MAX);
        assert_eq!(integer, source.as_str());
        let plain = "fn main() {}";
        assert_eq!(super::compiled_source(plain, F16Reads::Hardware, 0), plain);
    }

    /// A module with two packed operands and a packed output, as the elementwise families
    /// and matmul declare them.
    fn two_operand_module() -> String {
        let reads = |name: &str| {
            format!(
                "// F16 OPERAND {name} BEGIN\n\
                 fn {name}_at(i: u32) -> f32 {{ return bitcast<f32>({name}[i / 4u][i % 4u]); }}\n\
                 fn {name}_quad(q: u32) -> vec4<f32> {{ return bitcast<vec4<f32>>({name}[q]); }}\n\
                 // F16 OPERAND {name} END\n"
            )
        };
        format!(
            "@group(0) @binding(1) var<storage, read> lhs: array<vec4<u32>>;\n\
             @group(0) @binding(2) var<storage, read> rhs: array<vec4<u32>>;\n\
             @group(0) @binding(3) var<storage, read_write> dst: array<vec4<u32>>;\n\
             {}{}\
             @compute @workgroup_size(1)\n\
             fn main() {{ dst[0] = vec4<u32>(bitcast<u32>(lhs_at(0u) + rhs_quad(0u).x)); }}\n",
            reads("lhs"),
            reads("rhs")
        )
    }

    #[test]
    fn native_f16_reads_bind_only_the_f16_operands_as_wgsl_f16() {
        let source = two_operand_module();
        // lhs (binding 1) F16, rhs (2) BF16 or F32, dst (3) F16 but written.
        let native = super::compiled_source(&source, F16Reads::Native, 1 << 1 | 1 << 3);
        assert!(native.starts_with("enable f16;\n"));
        assert!(native.contains("var<storage, read> lhs: array<vec4<f16>>;"));
        assert!(native.contains("return f32(lhs[i / 4u][i % 4u]);"));
        assert!(native.contains("return vec4<f32>(lhs[q]);"));
        assert!(native.contains("var<storage, read> rhs: array<vec4<u32>>;"));
        assert!(native.contains("bitcast<vec4<f32>>(rhs[q])"));
        assert!(native.contains("var<storage, read_write> dst: array<vec4<u32>>;"));
        assert!(!native.contains("// F16 OPERAND lhs BEGIN"));
        let module = naga::front::wgsl::parse_str(&native).expect("parses");
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::SHADER_FLOAT16,
        )
        .validate(&module)
        .expect("validates");
    }

    #[test]
    fn native_f16_reads_leave_a_module_without_f16_operands_as_it_is() {
        let source = two_operand_module();
        assert_eq!(super::compiled_source(&source, F16Reads::Native, 0), source);
        assert_eq!(
            super::compiled_source(&source, F16Reads::Hardware, 1 << 1),
            source
        );
    }

    #[test]
    fn read_write_bindings_are_read_from_the_parsed_module() {
        let source = "@group(0) @binding(0) var<uniform> params: vec4<u32>;\n\
                      @group(0) @binding(1) var<storage, read> a: array<f32>;\n\
                      // @group(0) @binding(5) var<storage, read_write> gone: array<f32>;\n\
                      @group(0) @binding(12) var<storage, read_write> out1: array<f32>;\n\
                      @group(0)\n@binding(3)\nvar<storage, read_write> out: array<f32>;";
        assert_eq!(super::writable_bindings(source), vec![3, 12]);
    }
}
