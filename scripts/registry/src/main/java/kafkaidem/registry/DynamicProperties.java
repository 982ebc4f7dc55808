package kafkaidem.registry;

import io.apicurio.common.apps.config.DynamicConfigPropertyList;
import java.util.List;
import javax.enterprise.context.ApplicationScoped;
import javax.enterprise.inject.Produces;

/** What the config-index extension's build step would produce (its deployment artifact is
 *  not on Maven Central): no dynamic (runtime-changeable) configuration properties. */
@ApplicationScoped
public class DynamicProperties {
    @Produces
    @ApplicationScoped
    DynamicConfigPropertyList dynamicConfigPropertyList() {
        return new DynamicConfigPropertyList(List.of());
    }
}
