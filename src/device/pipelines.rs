//! `PipelineCache`: each (kernel, specialisation) is compiled once and kept for the life of
//! the device.

use std::collections::HashMap;
use std::sync::Arc;

/// A compiled compute pipeline and the layout of its one bind group.
pub(crate) struct CachedPipeline {
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
}

/// Compiled pipelines by key (`"family/specialisation:entry"`), and the shader modules they
/// come from by module key (`"family/specialisation"`): the entry points of one module share
/// one parse and validation.
#[derive(Default)]
pub(crate) struct PipelineCache {
    pipelines: HashMap<String, Arc<CachedPipeline>>,
    modules: HashMap<String, wgpu::ShaderModule>,
}

impl PipelineCache {
    /// The cached pipeline for `key`, compiling `source()`'s entry point on first use (and
    /// the module, the first time any entry of `module_key` is used).
    pub fn get_or_compile(
        &mut self,
        device: &wgpu::Device,
        key: &str,
        module_key: &str,
        entry: &str,
        source: impl FnOnce() -> String,
    ) -> Arc<CachedPipeline> {
        if let Some(cached) = self.pipelines.get(key) {
            return cached.clone();
        }
        let module = self
            .modules
            .entry(module_key.to_string())
            .or_insert_with(|| {
                device.create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(module_key),
                    source: wgpu::ShaderSource::Wgsl(source().into()),
                })
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
        let cached = Arc::new(CachedPipeline { pipeline, layout });
        self.pipelines.insert(key.to_string(), cached.clone());
        cached
    }

    /// How many pipelines have been compiled.
    pub fn len(&self) -> usize {
        self.pipelines.len()
    }
}
