//! The command recorder: the one open command encoder every op records into, the batch's
//! params, and its submission (when the host needs data, at a batch's limit, or after a
//! pipeline's first dispatch), with the bind groups eager dispatches and replays share.

use super::*;

/// The open batch: one command encoder, the parameters of its dispatches, and the ops that
/// recorded into it (to name them if the device rejects the batch).
#[derive(Default)]
pub(super) struct Recorder {
    encoder: Option<wgpu::CommandEncoder>,
    params: Vec<u8>,
    commands: u32,
    ops: Vec<&'static str>,
}

impl DeviceInner {
    /// The bind group of one dispatch of `cached`: its params slot (`PARAMS_BYTES` at an
    /// offset of a uniform buffer) at binding 0 and each `(binding, buffer)` as storage. Eager
    /// dispatches and captured replays both bind through here.
    pub(crate) fn bind_group(
        &self,
        op: &'static str,
        cached: &CachedPipeline,
        (params, params_offset): (&wgpu::Buffer, u64),
        buffers: &[(u32, BufferSlice)],
    ) -> wgpu::BindGroup {
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: params,
                offset: params_offset,
                size: wgpu::BufferSize::new(PARAMS_BYTES),
            }),
        }];
        for (binding, slice) in buffers {
            entries.push(wgpu::BindGroupEntry {
                binding: *binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: slice.buffer,
                    offset: slice.offset,
                    size: wgpu::BufferSize::new(slice.size),
                }),
            });
        }
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(op),
            layout: &cached.layout,
            entries: &entries,
        })
    }

    /// Records one dispatch of `cached` over `workgroups` workgroups, binding `params` as the
    /// uniform at binding 0 and each `(binding, buffer)` as storage.
    pub(crate) fn dispatch(
        &self,
        op: &'static str,
        cached: &CachedPipeline,
        buffers: &[(u32, BufferSlice)],
        params: &[u8],
        workgroups: u32,
    ) -> Result<()> {
        let limit = self.max_binding_bytes();
        if let Some((_, big)) = buffers.iter().find(|(_, b)| b.size > limit) {
            return Err(Error::TooLarge {
                op,
                bytes: big.size,
                limit,
            });
        }
        // The last slot stays 0: `pu` in shaders/common.wgsl indexes through it.
        assert!(
            params.len() < PARAMS_BYTES as usize,
            "{op}: too many kernel params"
        );
        if workgroups == 0 {
            return Ok(());
        }
        let mut rec = lock(&self.recorder);
        let offset = rec.params.len() as u64;
        rec.params.extend_from_slice(params);
        rec.params.resize((offset + PARAMS_BYTES) as usize, 0);

        let bind_group = self.bind_group(op, cached, (&self.params_buffer, offset), buffers);

        let (x, y) = workgroup_grid(workgroups);
        let encoder = self.open_encoder(&mut rec);
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(op),
                timestamp_writes: None,
            });
            pass.set_pipeline(&cached.pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            pass.dispatch_workgroups(x, y, 1);
        }
        self.dispatches.fetch_add(1, Ordering::Relaxed);
        self.take_error(op)?;
        // A pipeline's first dispatch submits the batch at once: software drivers compile a
        // pipeline's machine code on their queue thread when it first runs (lavapipe: 40 ms
        // to 0.45 s each), and submitted now that compile overlaps the host's recording of
        // what follows (and creating the next pipelines), instead of waiting for the batch
        // to fill. Only a model's first steps have new pipelines.
        let first_use = cached.unused.swap(false, Ordering::Relaxed);
        self.end_command(rec, op, first_use)
    }

    /// Records a copy of `data` into `target` at byte 0, ordered after all recorded work.
    /// (A `queue.write_buffer` would land before work already recorded into the open encoder,
    /// which may still read a pooled buffer's previous contents.)
    pub(crate) fn upload(
        &self,
        op: &'static str,
        target: &wgpu::Buffer,
        data: &[u8],
    ) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let staging = self.create_buffer(&wgpu::BufferDescriptor {
            label: Some("wgrad upload"),
            size: data.len() as u64,
            usage: wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: true,
        });
        staging
            .get_mapped_range_mut(..)
            .map_err(|e| Error::Device {
                op: op.to_string(),
                msg: e.to_string(),
            })?
            .copy_from_slice(data);
        self.in_context(|| staging.unmap());
        let mut rec = lock(&self.recorder);
        self.open_encoder(&mut rec).copy_buffer_to_buffer(
            &staging,
            0,
            target,
            0,
            data.len() as u64,
        );
        self.take_error(op)?;
        self.end_command(rec, op, false)
    }

    /// Records a buffer-to-buffer copy of `bytes` bytes, ordered after all recorded work.
    pub(crate) fn copy(
        &self,
        op: &'static str,
        src: (&wgpu::Buffer, u64),
        dst: (&wgpu::Buffer, u64),
        bytes: u64,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let mut rec = lock(&self.recorder);
        self.open_encoder(&mut rec)
            .copy_buffer_to_buffer(src.0, src.1, dst.0, dst.1, bytes);
        self.take_error(op)?;
        self.end_command(rec, op, false)
    }

    /// Copies `bytes` bytes at `offset` of `src` back to the host: submits everything
    /// recorded so far and waits for it.
    pub(crate) fn read(
        &self,
        op: &'static str,
        src: &wgpu::Buffer,
        offset: u64,
        bytes: u64,
    ) -> Result<Vec<u8>> {
        if bytes == 0 {
            self.flush()?;
            return Ok(Vec::new());
        }
        let staging = self.create_buffer(&wgpu::BufferDescriptor {
            label: Some("wgrad readback"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        {
            let mut rec = lock(&self.recorder);
            self.open_encoder(&mut rec)
                .copy_buffer_to_buffer(src, offset, &staging, 0, bytes);
            rec.ops.push(op);
        }
        let submission = self.flush()?;
        let mapped: Arc<Mutex<Option<std::result::Result<(), wgpu::BufferAsyncError>>>> =
            Arc::default();
        let slot = mapped.clone();
        self.in_context(|| {
            staging.map_async(wgpu::MapMode::Read, .., move |r| *lock(&slot) = Some(r))
        });
        self.wait(submission)?;
        while lock(&mapped).is_none() {
            self.poll_slice(None)?;
        }
        if let Some(Err(e)) = lock(&mapped).take() {
            return Err(Error::Device {
                op: op.to_string(),
                msg: e.to_string(),
            });
        }
        let data = staging
            .get_mapped_range(..)
            .map_err(|e| Error::Device {
                op: op.to_string(),
                msg: e.to_string(),
            })?
            .to_vec();
        self.in_context(|| {
            staging.unmap();
            drop(staging);
        });
        Ok(data)
    }

    fn open_encoder<'r>(&self, rec: &'r mut Recorder) -> &'r mut wgpu::CommandEncoder {
        rec.encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("wgrad batch"),
                })
        })
    }

    /// Counts one recorded command and submits the batch when it is full, or at once when
    /// `submit_now`.
    fn end_command(
        &self,
        mut rec: MutexGuard<'_, Recorder>,
        op: &'static str,
        submit_now: bool,
    ) -> Result<()> {
        rec.commands += 1;
        if rec.ops.last() != Some(&op) {
            rec.ops.push(op);
        }
        if submit_now || rec.commands >= self.batch_limit {
            self.submit(rec)?;
        }
        Ok(())
    }

    /// Submits `commands`, recorded outside the open batch (a captured step's replay), after
    /// the open batch, so that it runs after all work recorded before it. `queue_writes` are
    /// staged first: they land before `commands` run. Counts `dispatches`.
    pub(crate) fn submit_commands(
        &self,
        op: &'static str,
        queue_writes: &[(&wgpu::Buffer, u64, &[u8])],
        commands: wgpu::CommandBuffer,
        dispatches: u64,
    ) -> Result<()> {
        self.flush()?;
        self.in_context(|| {
            for (buffer, offset, data) in queue_writes {
                self.queue.write_buffer(buffer, *offset, data);
            }
            self.queue.submit([commands]);
        });
        self.submits.fetch_add(1, Ordering::Relaxed);
        self.dispatches.fetch_add(dispatches, Ordering::Relaxed);
        self.take_error(op)
    }

    /// Writes `data` into `buffer` at `offset` before the next submission runs (for buffers
    /// no recorded work reads: a captured plan's own params and staging buffers).
    pub(crate) fn write_buffer(&self, buffer: &wgpu::Buffer, offset: u64, data: &[u8]) {
        self.in_context(|| self.queue.write_buffer(buffer, offset, data));
    }

    /// Submits the open batch, if any. Returns the submission to wait on.
    pub(crate) fn flush(&self) -> Result<Option<wgpu::SubmissionIndex>> {
        self.submit(lock(&self.recorder))
    }

    fn submit(&self, mut rec: MutexGuard<'_, Recorder>) -> Result<Option<wgpu::SubmissionIndex>> {
        let Some(encoder) = rec.encoder.take() else {
            return Ok(None);
        };
        let submission = self.in_context(|| {
            if !rec.params.is_empty() {
                self.queue.write_buffer(&self.params_buffer, 0, &rec.params);
            }
            self.queue.submit([encoder.finish()])
        });
        self.submits.fetch_add(1, Ordering::Relaxed);
        let ops = std::mem::take(&mut rec.ops);
        rec.params.clear();
        rec.commands = 0;
        drop(rec);
        if !lock(&self.errors).is_empty() {
            let mut names: Vec<&str> = Vec::new();
            for op in ops {
                if !names.contains(&op) {
                    names.push(op);
                }
            }
            self.take_error(&format!(
                "one of the ops submitted together ({})",
                names.join(", ")
            ))?;
        }
        Ok(Some(submission))
    }

    /// Waits in bounded slices, so no poll holds GL's context lock long, for `submission`, or
    /// when there is none (nothing was open to submit) for everything submitted before: a batch
    /// that the batch limit submitted by itself may still be running.
    pub(super) fn wait(&self, submission: Option<wgpu::SubmissionIndex>) -> Result<()> {
        while !self.poll_slice(submission.clone())? {}
        self.take_error("synchronize")
    }

    /// One bounded poll: `true` when the submission (or the whole queue) is done, `false`
    /// when the time slice ran out first.
    fn poll_slice(&self, submission: Option<wgpu::SubmissionIndex>) -> Result<bool> {
        let wait = wgpu::PollType::Wait {
            submission_index: submission,
            timeout: Some(POLL_SLICE),
        };
        match self.in_context(|| self.device.poll(wait)) {
            Ok(_) => Ok(true),
            Err(wgpu::PollError::Timeout) => Ok(false),
            Err(e) => Err(Error::Device {
                op: "synchronize".into(),
                msg: e.to_string(),
            }),
        }
    }
}
