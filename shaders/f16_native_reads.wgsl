// The reads of an F16 operand bound as WGSL `array<vec4<f16>>` (`F16Reads::Native`): the
// device puts these, with OPERAND the operand's name, in place of a family's
// `// F16 OPERAND name BEGIN` .. `END` section when it compiles a module
// (`device/pipelines.rs`). The bytes are those of the packed words (element i at byte 2i);
// the adapter converts each half to f32 exactly.

// Element i of OPERAND.
fn OPERAND_at(i: u32) -> f32 {
    return f32(OPERAND[i / 4u][i % 4u]);
}

// Elements 4q .. 4q + 4 of OPERAND.
fn OPERAND_quad(q: u32) -> vec4<f32> {
    return vec4<f32>(OPERAND[q]);
}
