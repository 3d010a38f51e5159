//! `PipelineCache`: each (kernel, specialisation) is compiled once and kept for the life of
//! the device; the modules a captured step generates (keys under [`GENERATED`]) are dropped
//! once no plan holds their pipelines.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

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

/// What the device compiles for `source`: the source itself, or, with `F16Reads::Hardware`,
/// with `shaders/f16_hardware_reads.wgsl` in place of `sixteen_bit.wgsl`'s F16 READS section.
/// A module keeps the source it was given (`CachedPipeline::source`): that is what the
/// capture fuser builds from.
fn compiled_source(source: &str, hardware_f16_reads: bool) -> Cow<'_, str> {
    const BEGIN: &str = "// F16 READS BEGIN";
    const END: &str = "// F16 READS END";
    const HARDWARE: &str = include_str!("../../shaders/f16_hardware_reads.wgsl");
    let section = source
        .find(BEGIN)
        .and_then(|start| Some((start, source[start..].find(END)? + start + END.len())));
    match (hardware_f16_reads, section) {
        (true, Some((start, end))) => {
            Cow::Owned(format!("{}{HARDWARE}{}", &source[..start], &source[end..]))
        }
        _ => Cow::Borrowed(source),
    }
}

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
    /// The cached pipeline for `key`, compiling `source()`'s entry point on first use (and
    /// the module, the first time any entry of `module_key` is used).
    pub fn get_or_compile(
        &mut self,
        device: &wgpu::Device,
        hardware_f16_reads: bool,
        key: &str,
        module_key: &str,
        entry: &str,
        source: impl FnOnce() -> String,
    ) -> Arc<CachedPipeline> {
        if let Some(cached) = self.pipelines.get(key) {
            return cached.clone();
        }
        let (module, writable, module_source) = self
            .modules
            .entry(module_key.to_string())
            .or_insert_with(|| {
                let source: Arc<str> = source().into();
                let writable = writable_bindings(&source);
                let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(module_key),
                    source: wgpu::ShaderSource::Wgsl(compiled_source(&source, hardware_f16_reads)),
                });
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
    #[test]
    fn hardware_f16_reads_replace_the_integer_section_of_a_module() {
        let prelude = include_str!("../../shaders/sixteen_bit.wgsl");
        let source = format!("{prelude}\nfn main() {{}}");
        let hardware = super::compiled_source(&source, true);
        assert!(hardware.contains("unpack2x16float(h).x"));
        assert!(!hardware.contains("// F16 READS BEGIN\n"));
        assert_eq!(hardware.matches("fn f16_read(").count(), 1);
        assert_eq!(super::compiled_source(&source, false), source.as_str());
        let plain = "fn main() {}";
        assert_eq!(super::compiled_source(plain, true), plain);
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
