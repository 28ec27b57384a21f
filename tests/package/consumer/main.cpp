// Uses the installed Tessera: scatters a tensor over 2 local ranks and gathers it back.
#include <cstdio>
#include <tessera/tessera.hpp>
#include <vector>

int main() {
  using namespace tessera;
  std::vector<float> values(6 * 4);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i);
  const Tensor full = Tensor::from_values<float>({6, 4}, values);
  bool same = false;
  run_local_ranks(2, [&](std::shared_ptr<Comm> world) {
    DeviceMesh mesh(world, {2}, {"domain"});
    const ShardTensor sharded =
        ShardTensor::scatter(full, mesh, {Placement::shard(0)}, {{1, 5}}, /*root=*/0);
    const Tensor gathered = sharded.gather(0);
    if (world->rank() == 0) same = bitwise_equal(gathered, full);
  });
  std::printf("consumer: round trip %s\n", same ? "ok" : "FAILED");
  return same ? 0 : 1;
}
