//! Neural-network building blocks.

pub mod loss;
