mod common;
use common::*;
use wgrad::Tensor;

#[test]
fn smoke() {
    let dev = device();
    println!("{}", dev.info());
    let a = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], dev).unwrap();
    let b = Tensor::ones(&[2, 2], dev).unwrap();
    println!("{:?}", a.matmul(&b).unwrap().to_vec().unwrap());
    println!("{:?}", (&a + &b).unwrap().relu().unwrap().to_vec().unwrap());
    println!("{:?}", a.sum().unwrap().to_vec().unwrap());
    println!("{:?}", a.t().unwrap().contiguous().unwrap().to_vec().unwrap());
    println!("{:?}", a.softmax(1).unwrap().to_vec().unwrap());
    println!("{:?}", a.argmax(0, false).unwrap().to_vec_u32().unwrap());
    println!("{:?}", dev.stats());
}
