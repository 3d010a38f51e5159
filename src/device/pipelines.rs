//! `PipelineCache`: each (kernel, specialisation) is compiled once and kept for the life of
//! the device.

use std::collections::HashMap;
use std::sync::Arc;

/// A compiled compute pipeline and the layout of its one bind group.
pub(crate) struct CachedPipeline {
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
}

/// Compiled pipelines by key (`"family/specialisation:entry"`).
#[derive(Default)]
pub(crate) struct PipelineCache {
    pipelines: HashMap<String, Arc<CachedPipeline>>,
}

impl PipelineCache {
    /// The cached pipeline for `key`, compiling `source()`'s entry point on first use.
    pub fn get_or_compile(
        &mut self,
        device: &wgpu::Device,
        key: &str,
        entry: &str,
        source: impl FnOnce() -> String,
    ) -> Arc<CachedPipeline> {
        if let Some(cached) = self.pipelines.get(key) {
            return cached.clone();
        }
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(key),
            source: wgpu::ShaderSource::Wgsl(source().into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(key),
            layout: None,
            module: &module,
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
